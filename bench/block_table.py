"""Turn `mtpkit bench --random qwen3-... --num-draft-tokens ... --acceptance ... --json`
outputs (bench/gpu_bench.sh's `block-SHAPE` targets) into one markdown table.

    python bench/block_table.py DIR/block-*.json > block-table.md

One row per block-drafter run: the shape, K (drafts a round), the oracle per-position
acceptance, the speedup over stock in the same trials [min-max], the round's cost in 1-token
forwards (verify of K+1 tokens + one drafter pass) with the pass alone, and the ceiling
E_K / round cost; adaptive rows (generate's default, depth 1-3 chosen) have no round cost.
SYNTHETIC figures: what a drafter of that acceptance gains at this shape.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def cells(result: dict[str, Any], run: dict[str, Any]) -> list[str]:
    k = run["depth"]
    low, high = run["speedup_range"]
    passes = result.get("drafter_costs") or {}
    rounds = "-" if run.get("round_cost") is None else f"{run['round_cost']:.2f}"
    return [
        result["model"] + (f" ({result['dtype']})" if result.get("dtype") else ""),
        f"1-{k} adaptive" if run["adaptive"] else str(k),
        "-" if run["synthetic_acceptance"] is None else f"{run['synthetic_acceptance']:g}",
        f"**{run['speedup']:.2f}** [{low:.2f}-{high:.2f}]",
        rounds + (f" ({passes[str(k)]:.2f})" if str(k) in passes and not run["adaptive"] else ""),
        "-" if not run.get("ceiling") else f"{run['ceiling']:.2f}",
    ]


def table(results: list[dict[str, Any]]) -> str:
    columns = ["model", "K", "acceptance", "vs stock", "round cost (pass)", "ceiling"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for result in results:
        for run in [*result["runs"], *result["adaptive"]]:
            lines.append("| " + " | ".join(cells(result, run)) + " |")
    stock = ", ".join(f"{r['model']} {r['plain_tps']:.1f} tok/s" for r in results)
    trials = sorted({r["trials"] for r in results})
    lines.append(f"\nstock mlx-lm: {stock}; medians of {'/'.join(map(str, trials))} trials")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    print(table([json.loads(Path(p).read_text()) for p in paths]))


if __name__ == "__main__":
    main(sys.argv[1:])
