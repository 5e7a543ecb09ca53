"""How results reach people (rich tables on stdout) and machines (`--json`)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def progress_disabled(quiet: bool = False) -> bool:
    """Progress bars are off with --quiet or HF_HUB_DISABLE_PROGRESS_BARS=1."""
    env = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower()
    return quiet or env in ("1", "true", "yes", "on")


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def print_inspect(result: dict[str, Any], *, show_tensors: bool = True) -> None:
    mtp = result["mtp"]
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    where = result["source"] + (f"@{result['revision']}" if result["revision"] else "")
    summary.add_row(
        "source", where + (f" ({result['commit'][:12]})" if result.get("commit") else "")
    )
    summary.add_row("format", result["format"])
    summary.add_row("family", f"{result['family']} (model_type {result['model_type']})")
    declared = mtp["declared_layers"]
    summary.add_row(
        "MTP declared", "no field in config" if declared is None else f"{declared} layer(s)"
    )
    summary.add_row("MTP present", "yes" if mtp["present"] else "no")
    if mtp["present"]:
        needed = ""
        if mtp["bytes_needed"] != mtp["bytes"]:
            needed = f", {human_bytes(mtp['bytes_needed'])} without duplicated embeddings"
        summary.add_row(
            "MTP tensors", f"{mtp['tensor_count']} ({human_bytes(mtp['bytes'])}{needed})"
        )
        summary.add_row("MTP shards", ", ".join(mtp["shards"]))
        summary.add_row("expert layout", str(mtp["expert_layout"]))
        summary.add_row("dtypes", ", ".join(f"{k} x{v}" for k, v in mtp["dtypes"].items()))
        summary.add_row("quantized", "yes" if mtp["quantized"] else "no")
    summary.add_row("norm convention", mtp["norm_convention"])
    summary.add_row("concat order", mtp["concat_order"])
    stdout.print(summary)
    if show_tensors and mtp["tensors"]:
        table = Table(title="MTP tensors", title_justify="left")
        for col in ("name", "shape", "dtype", "bytes", "shard"):
            table.add_column(col, justify="right" if col == "bytes" else "left")
        for t in mtp["tensors"]:
            name = t["name"] + (f"  (copy of {t['duplicate_of']})" if "duplicate_of" in t else "")
            table.add_row(
                name, "x".join(map(str, t["shape"])), t["dtype"], str(t["bytes"]), t["shard"]
            )
        stdout.print(table)
    if result["problems"]:
        table = Table(title="Problems", title_justify="left")
        table.add_column("code", style="red")
        table.add_column("message")
        for p in result["problems"]:
            table.add_row(p["code"], p["message"])
        stdout.print(table)
    else:
        stdout.print("no problems found")
