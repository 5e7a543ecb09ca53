"""How results reach people (rich tables on stdout) and machines (`--json`)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.table import Table
from rich.text import Text

from mtpkit.core.console import printable, stdout

STATUS_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


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
    summary.add_column(overflow="fold")
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
        summary.add_row("layout", mtp["layout"])
        summary.add_row("expert layout", str(mtp["expert_layout"]))
        summary.add_row("dtypes", ", ".join(f"{k} x{v}" for k, v in mtp["dtypes"].items()))
        summary.add_row("quantized", "yes" if mtp["quantized"] else "no")
    summary.add_row("norm convention", mtp["norm_convention"])
    summary.add_row("concat order", mtp["concat_order"])
    for key, value in pairing_rows(result.get("pairing")):
        summary.add_row(key, value)
    stdout.print(summary)
    if show_tensors and mtp["tensors"]:
        table = Table(title="MTP tensors", title_justify="left")
        for col in ("name", "shape", "dtype", "bytes", "shard"):
            table.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
        for t in mtp["tensors"]:
            name = t["name"] + (f"  (copy of {t['duplicate_of']})" if "duplicate_of" in t else "")
            table.add_row(
                name, "x".join(map(str, t["shape"])), t["dtype"], str(t["bytes"]), t["shard"]
            )
        stdout.print(table)
    if result.get("runtimes"):
        print_runtimes(result["runtimes"])
    print_problems(result["problems"])


def pairing_rows(pairing: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Inspect's lines on a Gemma 4 target or assistant: what pairs the two."""
    if not pairing:
        return []
    if pairing["role"] == "assistant":
        return [
            ("pairs with", f"a target of hidden size {pairing['backbone_hidden_size']}, "
             f"vocabulary {pairing['vocab_size']}"),
            ("reads K/V of", ", ".join(pairing["layer_types"])
             + " (" + ", ".join(f"{k} head {v}" for k, v in pairing["head_dim"].items()) + ")"),
            ("output head", pairing["output_head"]
             + (f" ({pairing['num_centroids']} centroids, top {pairing['centroid_top_k']})"
                if pairing["ordered_embeddings"] else "")),
        ]  # fmt: skip
    wants = pairing["assistant"]
    sources = ", ".join(f"{k} layer {v}" for k, v in pairing["kv_source_layers"].items())
    return [
        ("assistant reads", sources),
        ("assistants that pair",
         f"backbone_hidden_size {wants['backbone_hidden_size']}, vocabulary "
         f"{wants['vocab_size']}, head sizes "
         + ", ".join(f"{k} {v}" for k, v in wants["head_dim"].items())
         + f", query heads a multiple of {wants['attention_heads_multiple_of']}"),
    ]  # fmt: skip


def print_runtimes(rows: list[dict[str, Any]]) -> None:
    """Which MLX runtimes run the directory, and with its head or plainly."""
    table = Table(title="Runs in", title_justify="left")
    for col in ("runtime", "version", "runs", "MTP", "how / why not"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(
            r["runtime"], r["version"], "yes" if r["runs"] else "no",
            "yes" if r["mtp"] else "no", r["note"],
        )  # fmt: skip
    stdout.print(table)


def print_check(result: dict[str, Any]) -> None:
    """The `mtpkit check` table and its verdict line."""
    where = result["source"] + (f"@{result['revision']}" if result.get("revision") else "")
    table = Table(title=f"mtpkit check {where}", title_justify="left")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for c in result["checks"]:
        table.add_row(c["name"], Text(c["status"], style=STATUS_STYLE[c["status"]]), c["detail"])
    stdout.print(table)
    line = f"verdict: {result['verdict']}"
    if result.get("acceptance") is not None:
        line += f" (acceptance {_pct(result['acceptance'])} as shipped"
        best = result.get("best_variant")
        if best and (best["norm_shift"] or best["acceptance"] != result["acceptance"]):
            line += (
                f"; best {_pct(best['acceptance'])} with norms {best['norm_shift']:+d}, "
                f"{best['hidden']}, {best['concat_order']}"
            )
        line += ")"
    elif not any(c["name"] == "acceptance" and c["status"] != "skip" for c in result["checks"]):
        line += " (no probes run)"
    if result.get("moe_dtype"):
        line += f"; experts ran in {result['moe_dtype']}"
    stdout.print(Text(printable(line), style=STATUS_STYLE[result["verdict"]]))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def print_convert(result: Any) -> None:
    """The one line `mtpkit convert` prints (a `ConvertResult`): what was written, its size,
    and the backbone's bits per weight (mlx_lm.convert's "Quantized model with 4.564 bits per
    weight", for every conversion); a graft counts only the head it added."""
    size = human_bytes(result.written_bytes)
    if result.grafted:
        print(
            f"grafted {result.head_tensors} MTP tensors into {result.output}: {result.family}, "
            f"{size} written in {result.seconds:.1f}s",
            flush=True,
        )
        return
    bpw = (
        f", {result.bits_per_weight:.3f} bits per weight"
        if result.bits_per_weight is not None
        else ""
    )
    print(
        f"wrote {result.output}: {result.family}, {result.backbone_tensors} backbone and "
        f"{result.head_tensors} MTP tensors, {size}{bpw}, in {result.seconds:.1f}s",
        flush=True,
    )


# mlx_lm.generate's framing of the text (`generate(..., verbose=True)`).
FRAME = "=" * 10


DRAFTER_NAMES = {
    "draft-model": "draft model",
    "prompt-lookup": "prompt lookup",
    "gemma4-assistant": "Gemma 4 assistant",
    "dflash": "DFlash block drafter",
    "eagle3": "EAGLE-3 drafter",
}


def print_generate(result: Any) -> None:
    """After the streamed text, mlx_lm.generate's closing frame and its `Prompt:`,
    `Generation:` and `Peak memory:` lines (same wording and precision), then mtpkit's `MTP:`
    line; all on stdout, as mlx-lm prints them."""
    print()
    print(FRAME)
    if not result.text:
        print("No text generated for this prompt", flush=True)
        return
    # The first token's time is the prompt's, as in mlx-lm; with no token after it there
    # is no decode rate to report.
    tps = "n/a" if result.decode_tps is None else f"{result.decode_tps:.3f}"
    print(f"Prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {result.generation_tokens} tokens, {tps} tokens-per-sec")
    print(f"Peak memory: {result.peak_memory_gb:.3f} GB")
    if result.mtp:
        acc = "n/a" if result.acceptance is None else f"{result.acceptance:.1%}"
        depth = f"depth {result.depth}"
        if result.depth_chosen:  # adaptive drafting chose each round's depth
            rounds = "/".join(str(n) for n in result.rounds_by_depth)
            depth = f"depth 1-{result.depth} (rounds at each: {rounds})"
        line = f"MTP: {depth}, acceptance {acc} ({result.accepted}/{result.drafted})"
        if result.drafter != "mtp":  # another proposer drafted, not the head
            line = f"Drafter: {DRAFTER_NAMES[result.drafter]}, {line.removeprefix('MTP: ')}"
    else:
        line = "MTP: off (plain decoding)"
    if result.moe_dtype:
        line += f"; experts in {result.moe_dtype}"
    print(line, flush=True)


def print_train(result: dict[str, Any]) -> None:
    """`mtpkit train-head`'s summary (the `--json` object of `TrainResult.to_json`)."""

    def acc(x: float | None) -> str:
        return "n/a" if x is None else _pct(x)

    trained = result["steps"] - result["resumed_from"]
    resumed = f" (resumed at {result['resumed_from']})" if result["resumed_from"] else ""
    print(
        f"wrote {result['output']}: {result['family']} MTP head, {result['steps']} steps{resumed}"
    )
    print(
        f"held-out acceptance: {acc(result['heldout_acceptance_start'])} at start, "
        f"{acc(result['heldout_acceptance'])} at the end; loss {result['loss_first']:.4f} -> "
        f"{result['loss_last']:.4f}"
        if result["loss_first"] is not None
        else f"held-out acceptance: {acc(result['heldout_acceptance'])}"
    )
    print(
        f"{trained} steps in {result['seconds']:.1f}s ({result['steps_per_s']:.2f} steps/s, "
        f"{result['cpu_seconds'] / 60:.1f} CPU minutes), peak RSS "
        f"{human_bytes(result['peak_rss_bytes'])}, peak MLX memory "
        f"{human_bytes(result['peak_mlx_bytes'])}",
        flush=True,
    )


def print_problems(problems: list[dict[str, str]]) -> None:
    """`inspect`'s problems table (code, message), or a line saying there are none."""
    if not problems:
        stdout.print("no problems found")
        return
    table = Table(title="Problems", title_justify="left")
    table.add_column("code", style="red")
    table.add_column("message", overflow="fold")
    for p in problems:
        table.add_row(p["code"], p["message"])
    stdout.print(table)
