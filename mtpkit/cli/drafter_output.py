"""How `mtpkit inspect` shows a block drafter (`mtpkit.checkpoint.drafters`) to people."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from mtpkit.cli.output import human_bytes, print_problems
from mtpkit.core.console import stdout


def print_drafter(result: dict[str, Any]) -> None:
    d = result["drafter"]
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column(overflow="fold")
    where = result["source"] + (f"@{result['revision']}" if result["revision"] else "")
    target = d["target"]
    layers = target["num_hidden_layers"]
    rows = [
        ("source", where),
        ("drafter", f"{d['kind']} ({d['architecture']}), {d['layers']} layer(s)"),
        ("target", (f"{target['name']}: " if target.get("name") else "")
                   + f"{layers if layers is not None else 'N'} layers, hidden size "
                   f"{target['hidden_size']}, vocabulary {target['vocab_size']}"),  # fmt: skip
        *(_eagle3_rows(d) if d["kind"] == "eagle3" else _dflash_rows(d)),
        ("vocabulary mapping", d["vocabulary"]),
        ("tensors", f"{d['tensor_count']} ({human_bytes(d['bytes'])})"),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in d["dtypes"].items())),
        ("quantized", "yes" if d["quantized"] else "no"),
    ]
    if result.get("pairing"):
        fits = "yes" if not result["pairing"]["problems"] else "no"
        rows.append(("drafts for " + result["pairing"]["target"], fits))
    for key, value in rows:
        summary.add_row(key, value)
    stdout.print(summary)
    print_problems(result["problems"])


def _dflash_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    mask = d["mask_token_id"]
    return [
        ("target layers read", ", ".join(map(str, d["target_layer_ids"]))),
        ("block size", f"{d['block_size']} (up to {d['max_drafts']} drafts a pass)"),
        ("mask token", f"{mask}" + (f" ({d['mask_token']})" if d["mask_token"] else "")),
    ]


def _eagle3_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    ids = d["target_layer_ids"]
    read = d["target_layer_rule"] if ids is None else ", ".join(map(str, ids))
    if ids is not None:
        read = f"inputs of {read}" + ("" if d["target_layer_rule"] == "config" else " (default)")
    d2t = d["d2t"]
    mapping = "none (drafts over every target token)"
    if d2t["target_ids"] is not None:
        low, high = d2t["target_ids"]
        mapping = f"draft id + offset -> target ids {low}..{high}"
    return [
        ("target layers read", read),
        ("draft vocabulary", f"{d['draft_vocab_size']} tokens"),
        ("d2t", mapping),
    ]
