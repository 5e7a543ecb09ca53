"""Turn `mtpkit bench --json` outputs into one markdown table.

    python bench/bench_table.py results/*.json > table.md

One row per file: the model, the device and MLX version it ran on, stock mlx-lm's decode
tok/s, `--no-mtp` over stock, beta and delta, and per depth the acceptance, the realized
speedup over stock and the ceiling (1+a)/(beta+delta) with the realized share of it, then
adaptive drafting (`generate --mtp`'s default). Figures are medians of interleaved trials,
[min-max] after them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def spread(value: float, bounds: list[float] | None, fmt: str = "{:.2f}") -> str:
    text = fmt.format(value)
    if bounds:
        text += " [" + "-".join(fmt.format(b) for b in bounds) + "]"
    return text


def run_cell(run: dict[str, Any]) -> str:
    acceptance = run.get("acceptance")
    cell = "-" if acceptance is None else f"{acceptance:.0%}"
    cell += " / " + spread(run["speedup"], run.get("speedup_range")) + "x"
    if run.get("ceiling"):
        cell += f" / {run['ceiling']:.2f} ({run['speedup'] / run['ceiling']:.0%})"
    return cell


def row(result: dict[str, Any], depths: int) -> str:
    model = result["model"] + (f" ({result['dtype']})" if result.get("dtype") else "")
    runs = {r["depth"]: r for r in result["runs"]}
    cells = [
        model,
        f"{result.get('device', '?')}, mlx {result.get('mlx', '?')}",
        spread(result["plain_tps"], result.get("plain_tps_range"), "{:.1f}"),
        f"{result['no_mtp_tps'] / result['plain_tps']:.2f}" if result.get("no_mtp_tps") else "-",
        spread(result["beta"], result.get("beta_range")),
        spread(result["delta"], result.get("delta_range")),
    ]
    cells += [run_cell(runs[d]) if d in runs else "" for d in range(1, depths + 1)]
    adaptive = result.get("adaptive") or []
    cells.append(run_cell(adaptive[0]) if adaptive else "")
    return "| " + " | ".join(cells) + " |"


def table(results: list[dict[str, Any]]) -> str:
    depths = max((len(r["runs"]) for r in results), default=0)
    columns = ["model", "device", "stock tok/s", "--no-mtp / stock", "beta", "delta"]
    columns += [f"depth {d}: acceptance / speedup / ceiling" for d in range(1, depths + 1)]
    columns.append("adaptive (depth 1-3 chosen)")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += [row(r, depths) for r in results]
    trials = sorted({r.get("trials") for r in results if r.get("trials")})
    lines.append("")
    lines.append(
        f"Medians [min-max] of {'/'.join(map(str, trials)) or '?'} interleaved trials; speedups "
        "are MTP decode tok/s over stock mlx-lm's in the same trial; beta: a 2-token verify "
        "over a 1-token forward; delta: a head step over a 1-token forward; (x%): realized "
        "over ceiling."
    )
    return "\n".join(lines)


def _synthetic_cell(
    result: dict[str, Any], acceptance: float, adaptive: bool
) -> str | tuple[str, str]:
    """The speedup at one oracle acceptance: depth 1 or best fixed depth, or adaptive."""
    runs = result["adaptive" if adaptive else "runs"]
    runs = [r for r in runs if r.get("synthetic_acceptance") == acceptance]
    if not runs:
        return "-"
    if adaptive:
        r = runs[0]
        return spread(r["speedup"], r.get("speedup_range")) + "x"
    depth1 = next(r for r in runs if r["depth"] == 1)
    best = max(runs, key=lambda r: r["speedup"])
    return (
        spread(depth1["speedup"], depth1.get("speedup_range")) + "x",
        spread(best["speedup"], best.get("speedup_range")) + f"x (depth {best['depth']})",
    )


def targets_table(results: list[dict[str, Any]]) -> str:
    """README "Performance": per shape, `--acceptance 0,0.8,0.9` runs against the targets."""
    columns = [
        "model", "context", "stock tok/s", "stock / stock", "--no-mtp / stock", "acceptance 0.8, depth 1",
        "acceptance 0.9, best depth", "acceptance 0, adaptive", "acceptance 0.9, adaptive",
        "reliable",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for result in results:
        at08 = _synthetic_cell(result, 0.8, False)
        at09 = _synthetic_cell(result, 0.9, False)
        cells = [
            result["model"],
            str(result.get("prompt_tokens", "?")),
            spread(result["plain_tps"], result.get("plain_tps_range"), "{:.1f}"),
            spread(result["stock_self"], result.get("stock_self_range"))
            if result.get("stock_self") is not None
            else "-",
            spread(result["no_mtp_speedup"], result.get("no_mtp_speedup_range")),
            at08[0] if isinstance(at08, tuple) else at08,
            at09[1] if isinstance(at09, tuple) else at09,
            _synthetic_cell(result, 0.0, True),
            _synthetic_cell(result, 0.9, True),
            "yes"
            if result.get("reliable")
            else "no: " + "; ".join(result.get("unreliable_because", [])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    trials = sorted({r.get("trials") for r in results if r.get("trials")})
    devices = sorted({f"{r.get('device')}, mlx {r.get('mlx')}" for r in results})
    lines += [
        "",
        f"SYNTHETIC (oracle drafts at the stated acceptance). Medians [min-max] of "
        f"{'/'.join(map(str, trials)) or '?'} interleaved trials on {'; '.join(devices)}; "
        "speedup = MTP decode tok/s over stock mlx-lm's in the same trial; stock / stock: "
        "each stock run inside a trial over the ones around it, read as a speedup is (the "
        "noise every speedup carries).",
    ]
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    if not paths:
        sys.exit(__doc__)
    results = []
    for p in paths:
        try:
            results.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:  # a run that failed or timed out: its log says why
            print(f"skipped {p}: {e}", file=sys.stderr)
    synthetic = [r for r in results if r.get("synthetic")]
    if synthetic:
        print(targets_table(synthetic))
        print()
    real = [r for r in results if not r.get("synthetic")]
    if real:
        print(table(real))


if __name__ == "__main__":
    main(sys.argv[1:])
