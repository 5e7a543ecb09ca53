"""Each bench run's baseline: stock's rate interpolated in time between the stock runs around
it (`mtpkit.bench.anchors`), on a clock the test sets."""

from __future__ import annotations

import pytest

from mtpkit.bench import anchors
from mtpkit.bench.anchors import Anchored


class Clock:
    """perf_counter that moves one second per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_stock_runs_open_the_trial_recur_and_close_it_and_baselines_interpolate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(anchors.time, "perf_counter", Clock())
    rates = iter([100.0, 60.0, 80.0])  # stock slows, then recovers
    trial: Anchored[str] = Anchored(lambda: next(rates), every=2)
    assert trial.anchor() == 100.0  # reads 1, 2: midpoint 1.5
    for name in ("a", "b", "c"):  # a: 3-4, b: 5-6; stock 7-8 (after 2 runs); c: 9-10
        assert trial.timed(lambda name=name: name) == name
    paired = trial.finish()  # stock 11-12
    assert trial.stock_rates == [100.0, 60.0, 80.0]
    assert [name for name, _ in paired] == ["a", "b", "c"]
    # a at 3.5: a third of the way from (1.5, 100) to (7.5, 60); b at 5.5: two thirds
    assert paired[0][1] == pytest.approx(100 - 40 * 2 / 6)
    assert paired[1][1] == pytest.approx(100 - 40 * 4 / 6)
    # c at 9.5: half way from (7.5, 60) to (11.5, 80)
    assert paired[2][1] == pytest.approx(70.0)
    # the inner stock run (60 at 7.5) against the two around it: 100 at 1.5, 80 at 11.5
    assert trial.self_ratios() == pytest.approx([60.0 / (100 - 20 * 6 / 10)])


def test_stock_over_itself_is_one_on_a_steady_machine_and_needs_three_stock_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(anchors.time, "perf_counter", Clock())
    steady: Anchored[int] = Anchored(lambda: 80.0, every=1)
    for i in range(3):
        steady.timed(lambda i=i: i)
    steady.finish()
    assert len(steady.stock_rates) == 4
    assert steady.self_ratios() == pytest.approx([1.0, 1.0])
    short: Anchored[int] = Anchored(lambda: 80.0, every=4)
    short.timed(lambda: 1)
    short.finish()
    assert short.self_ratios() == []


def test_a_trial_without_a_stock_run_first_opens_with_one(monkeypatch) -> None:
    monkeypatch.setattr(anchors.time, "perf_counter", Clock())
    calls: list[str] = []
    trial: Anchored[int] = Anchored(lambda: calls.append("stock") or 50.0, every=4)
    trial.timed(lambda: calls.append("run") or 1)
    assert calls == ["stock", "run"]
    assert trial.finish() == [(1, 50.0)]
    assert calls == ["stock", "run", "stock"]
