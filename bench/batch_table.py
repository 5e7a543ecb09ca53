"""One markdown table from `mtpkit bench --batch ... --json` outputs (bench/gpu_bench.sh's
batch-SHAPE targets): per shape and width, stock mlx-lm's aggregate decode tok/s and MTP's
(depth 1, drafting every round, and adaptive) at each oracle acceptance, as medians of the
interleaved trials over stock in the same trials, with their ranges.

    python bench/batch_table.py DIR/batch-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def cell(fig: dict) -> str:
    lo, hi = fig["range"]
    return f"**{fig['median']:.2f}** [{lo:.2f}-{hi:.2f}]"


def main(paths: list[str]) -> None:
    print("| shape | batch | stock tok/s [range] | " "acc | MTP d1 / stock | adaptive / stock | "
          "plain share (adaptive) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            print(f"| {Path(path).name} | unreadable: {e} |||||")
            continue
        if "widths" not in data:
            print(f"| {Path(path).name} | {data.get('error', 'no widths')} |||||")
            continue
        shape = Path(path).stem.removeprefix("batch-")
        for width in data["widths"]:
            lo, hi = width["stock_tps"]["range"]
            stock = f"{width['stock_tps']['median']:.1f} [{lo:.0f}-{hi:.0f}]"
            for acc, fixed in width["mtp"].items():
                adaptive = width["mtp_adaptive"][acc]
                share = adaptive.get("plain_share")
                print(
                    f"| {shape} | {width['batch']} | {stock} | {acc} | {cell(fixed['speedup'])} "
                    f"| {cell(adaptive['speedup'])} | "
                    f"{'' if share is None else f'{share:.0%}'} |"
                )
    if paths:
        data = json.loads(Path(paths[0]).read_text())
        print(f"\n{data.get('device', '?')}; {data.get('trials')} trials, "
              f"{data.get('max_tokens')} tokens, prompt {data.get('prompt_tokens')} tokens")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
