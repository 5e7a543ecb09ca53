"""Stock runs spread through a bench trial, and each run's baseline read between the two
around it.

A speedup is a run's rate over stock mlx-lm's in the same trial. A trial of `mtpkit bench
--acceptance 0,0.8,0.9 --depth 3` is 14 runs back to back, 20-60 s on a GPU, and on a shared
host a machine's speed drifts within that: at 4b on an H100 (2026-11-27, bd2f66b) stock
decoded at 59 tok/s in one trial and 107 in the next, and the runs after each stock run
followed it. Against the trial's single stock run, opening it, a configuration's speedup
spread 15-29% (relative standard deviation over 4 trials) at the four random shapes; against
stock interpolated between that run and the next trial's by the run's place in the trial,
12-16% (`python bench/baseline_spread.py bench/results/2026-11-27-session8-x4-*bench-qwen*.log`).
So a trial now runs stock at its start, after every `EVERY` other runs and at its end, and
each run's baseline is stock's rate interpolated to the run's midpoint in time between the
stock runs before and after it.

The same reading gives the noise every speedup carries (`self_ratios`): each stock run inside
a trial, read as a run against the stock runs before and after it, is stock's "speedup" over
itself, 1 on a quiet machine. Its spread is what a speedup of a configuration cannot be told
apart from (on the H100s of 2026-11-28, a second stock load of the same model decoded at
0.91-1.15 of the first in the same trials: `bench/plain_steps.py`). Its neighbours are
`EVERY` runs further apart than a configuration's, so it overstates the noise a little.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

EVERY = 4  # runs between two stock runs of a trial

T = TypeVar("T")


def rate_at(points: list[tuple[float, float]], at: float) -> float:
    """Stock's rate at `at` from its (time, tok/s) `points` in time order: linear between the
    ones around it, else the nearest."""
    before = [p for p in points if p[0] <= at]
    after = [p for p in points if p[0] > at]
    if not before or not after:
        return (before or after)[-1 if before else 0][1]
    (t0, r0), (t1, r1) = before[-1], after[0]
    return r0 + (r1 - r0) * (at - t0) / (t1 - t0)


def self_ratios(points: list[tuple[float, float]]) -> list[float]:
    """Each of stock's (time, tok/s) `points` but the first and last over `rate_at` the
    others: stock's speedup over itself."""
    ratios = []
    for i in range(1, len(points) - 1):
        at, rate = points[i]
        around = rate_at(points[:i] + points[i + 1 :], at)
        if around > 0:
            ratios.append(rate / around)
    return ratios


@dataclass
class _Run(Generic[T]):
    result: T
    midpoint: float


@dataclass
class Anchored(Generic[T]):
    """One trial: `anchor()` runs stock, `timed(fn)` a configuration (stock again after
    every `every` of them); `finish()` runs stock a last time and pairs each result with its
    baseline, in order."""

    stock: Callable[[], float]
    every: int = EVERY
    anchors: list[tuple[float, float]] = field(default_factory=list)  # (midpoint, tok/s)
    runs: list[_Run[T]] = field(default_factory=list)
    since: int = 0

    def anchor(self) -> float:
        t0 = time.perf_counter()
        rate = self.stock()
        self.anchors.append(((t0 + time.perf_counter()) / 2, rate))
        self.since = 0
        return rate

    def timed(self, fn: Callable[[], T]) -> T:
        if not self.anchors or self.since >= self.every:
            self.anchor()
        t0 = time.perf_counter()
        result = fn()
        self.runs.append(_Run(result, (t0 + time.perf_counter()) / 2))
        self.since += 1
        return result

    def finish(self) -> list[tuple[T, float]]:
        self.anchor()
        return [(run.result, self.baseline(run.midpoint)) for run in self.runs]

    def baseline(self, at: float) -> float:
        """Stock's rate at time `at`: linear between the stock runs around it."""
        return rate_at(self.anchors, at)

    def self_ratios(self) -> list[float]:
        """Each stock run but the first and last over the stock runs around it, read as a
        configuration's run is read (`baseline` without it): stock's speedup over itself."""
        return self_ratios(self.anchors)

    @property
    def stock_rates(self) -> list[float]:
        return [rate for _, rate in self.anchors]
