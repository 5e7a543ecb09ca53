"""How much a bench speedup's spread owes to the machine drifting within a trial.

    python bench/baseline_spread.py bench-SHAPE.log [...]

From a bench progress log (before `anchors.Anchored`: one stock run opening each trial), for
each configuration its speedups over the trials three ways: over the trial's opening stock
run, over the mean of that run and the next trial's, and over stock interpolated between the
two by the run's place in the trial. Prints the mean relative standard deviation of each
(trials with a next trial only): the smaller, the better a baseline tracks the machine.
"""

import statistics
import sys
from pathlib import Path

from log_table import STOCK, trials  # bench/log_table.py: the same lines, parsed once


def spread(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


for path in sys.argv[1:]:
    by_trial = trials(Path(path).read_text())
    found = {t: dict(runs) for t, runs in by_trial.items()}
    order = {t: [name for name, _ in runs] for t, runs in by_trial.items()}
    counted = [t for t in sorted(found) if STOCK in found.get(t + 1, {})]
    places = order[1]
    ways: dict[str, list[float]] = {"opening": [], "bracket": [], "interpolated": []}
    for name in places[1:]:
        i = places.index(name) / len(places)
        ts = [t for t in counted if name in found[t]]
        s0 = [found[t][STOCK] for t in ts]
        s1 = [found[t + 1][STOCK] for t in ts]
        rates = [found[t][name] for t in ts]
        ways["opening"].append(spread([r / a for r, a in zip(rates, s0, strict=True)]))
        ways["bracket"].append(
            spread([r / ((a + b) / 2) for r, a, b in zip(rates, s0, s1, strict=True)])
        )
        ways["interpolated"].append(
            spread([r / (a + (b - a) * i) for r, a, b in zip(rates, s0, s1, strict=True)])
        )
    means = ", ".join(f"{k} {statistics.mean(v):.3f}" for k, v in ways.items())
    print(f"{path}: {len(counted)} trials; {means}")
