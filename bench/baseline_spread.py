"""How much a bench speedup's spread owes to the machine drifting within a trial.

    python bench/baseline_spread.py bench-SHAPE.log [...]

From a bench progress log (before `anchors.Anchored`: one stock run opening each trial), for
each configuration its speedups over the trials three ways: over the trial's opening stock
run, over the mean of that run and the next trial's, and over stock interpolated between the
two by the run's place in the trial. Prints the mean relative standard deviation of each
(trials with a next trial only): the smaller, the better a baseline tracks the machine.
"""

import re
import statistics
import sys
from collections import defaultdict

LINE = re.compile(r"^\.\.\. trial (\d+)/(\d+): (.+?) ([\d.]+) tok/s")
STOCK = "stock mlx-lm"


def spread(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values)


for path in sys.argv[1:]:
    found: dict[int, dict[str, float]] = defaultdict(dict)
    order: dict[int, list[str]] = defaultdict(list)
    for line in open(path):
        match = LINE.match(line)
        if match:
            found[int(match[1])][match[3]] = float(match[4])
            order[int(match[1])].append(match[3])
    trials = [t for t in sorted(found) if STOCK in found.get(t + 1, {})]
    places = order[1]
    ways: dict[str, list[float]] = {"opening": [], "bracket": [], "interpolated": []}
    for name in places[1:]:
        i = places.index(name) / len(places)
        ts = [t for t in trials if name in found[t]]
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
    print(f"{path}: {len(trials)} trials; {means}")
