"""Speedups from `mtpkit bench`'s progress log, for a run cut off before its JSON was written.

    python bench/log_table.py bench-SHAPE.log [...]

bench prints one line per timed run ("... trial 3/5: MTP depth 1 at oracle acceptance 0.8
121.4 tok/s, ..."); each configuration's speedup is its tok/s over stock mlx-lm's in the same
trial. One markdown row per configuration: the medians [min-max] over the trials complete in
the log (a trial whose stock line is missing is dropped; the untimed trial is never counted),
and its fastest trial over stock's fastest: on a shared host, where a disturbance only ever
slows a run, what each ran at undisturbed (a diagnostic beside the medians, not a target).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\.\.\. trial (\d+)/(\d+): (.+?) ([\d.]+) tok/s")
STOCK = "stock mlx-lm"


def trials(text: str) -> dict[int, dict[str, float]]:
    """{trial: {configuration: tok/s}} of every timed line."""
    found: dict[int, dict[str, float]] = defaultdict(dict)
    for line in text.splitlines():
        match = LINE.match(line)
        if match:
            found[int(match[1])][match[3]] = float(match[4])
    return dict(found)


def rows(found: dict[int, dict[str, float]]) -> list[str]:
    stocked = {t: runs for t, runs in found.items() if STOCK in runs}
    names = list(dict.fromkeys(name for runs in stocked.values() for name in runs))
    lines = []
    best_stock = max(runs[STOCK] for runs in stocked.values())
    for name in names:
        rates = [runs[name] for runs in stocked.values() if name in runs]
        ratios = [runs[name] / runs[STOCK] for runs in stocked.values() if name in runs]
        cell = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        rate = f"{statistics.median(rates):.1f} [{min(rates):.1f}-{max(rates):.1f}]"
        best = max(rates) / best_stock
        lines.append(f"| {name} | {len(ratios)} | {rate} | {cell} | {best:.2f} |")
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        print(f"\n{path}\n")
        print("| configuration | trials | tok/s | over stock | fastest over stock's fastest |")
        print("|---|---|---|---|---|")
        print("\n".join(rows(trials(Path(path).read_text()))))


if __name__ == "__main__":
    main(sys.argv[1:])
