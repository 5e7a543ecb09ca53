"""Speedups from `mtpkit bench`'s progress log, for a run cut off before its JSON was written.

    python bench/log_table.py bench-SHAPE.log [...]

bench prints one line per timed run ("... trial 3/5: MTP depth 1 at oracle acceptance 0.8
121.4 tok/s, ..."). Each configuration's speedup is its tok/s over stock mlx-lm's in the same
trial: where the trial ran stock more than once (`mtpkit.bench.anchors`), over stock
interpolated by the run's place between the stock runs around it, as bench does by time.
One markdown row per configuration: the medians [min-max] over the trials in the log (the
untimed trial is never counted; a trial without a stock line is dropped), and its fastest
trial over stock's fastest: on a shared host, where a disturbance only ever slows a run, what
each ran at undisturbed (a diagnostic beside the medians, not a target). Stock's own row
reads, in its "over stock" cell, each stock run inside a trial over the ones around it:
stock against itself, the noise every other row carries.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from mtpkit.bench.anchors import rate_at, self_ratios

LINE = re.compile(r"^\.\.\. trial (\d+)/(\d+): (.+?) ([\d.]+) tok/s")
STOCK = "stock mlx-lm"


def trials(text: str) -> dict[int, list[tuple[str, float]]]:
    """{trial: [(configuration, tok/s), ...] in the order run}."""
    found: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            found[int(match[1])].append((match[3], float(match[4])))
    return dict(found)


def _stock_points(runs: list[tuple[str, float]]) -> list[tuple[float, float]]:
    """(place, tok/s) of the trial's stock runs: `anchors` reads them by place here."""
    return [(i, rate) for i, (name, rate) in enumerate(runs) if name == STOCK]


def baselines(runs: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    """(configuration, tok/s, stock's tok/s interpolated to its place) of each other run."""
    stock = _stock_points(runs)
    return [(name, rate, rate_at(stock, i)) for i, (name, rate) in enumerate(runs) if name != STOCK]


def rows(found: dict[int, list[tuple[str, float]]]) -> list[str]:
    stocked = {t: runs for t, runs in found.items() if any(n == STOCK for n, _ in runs)}
    if not stocked:
        return []
    paired = {t: baselines(runs) for t, runs in stocked.items()}
    stock_rates = [r for runs in stocked.values() for n, r in runs if n == STOCK]
    names = list(dict.fromkeys(n for runs in paired.values() for n, _, _ in runs))
    itself = [x for runs in stocked.values() for x in self_ratios(_stock_points(runs))]
    over = _cell(itself, "{:.2f}") if itself else "1.00"
    lines = [f"| {STOCK} | {len(stock_rates)} runs | {_cell(stock_rates, '{:.1f}')} | {over} | 1.00 |"]
    for name in names:
        rates = [r for runs in paired.values() for n, r, _ in runs if n == name]
        ratios = [r / b for runs in paired.values() for n, r, b in runs if n == name and b]
        best = max(rates) / max(stock_rates)
        lines.append(
            f"| {name} | {len(ratios)} | {_cell(rates, '{:.1f}')} | {_cell(ratios, '{:.2f}')} "
            f"| {best:.2f} |"
        )
    return lines


def _cell(values: list[float], fmt: str) -> str:
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return f"{fmt.format(statistics.median(values))} [{low}-{high}]"


def main(paths: list[str]) -> None:
    for path in paths:
        print(f"\n{path}\n")
        print("| configuration | trials | tok/s | over stock | fastest over stock's fastest |")
        print("|---|---|---|---|---|")
        print("\n".join(rows(trials(Path(path).read_text()))))


if __name__ == "__main__":
    main(sys.argv[1:])
