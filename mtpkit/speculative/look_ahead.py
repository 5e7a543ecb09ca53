"""Whether the next drafting round is looked ahead: launched before this round's verdict is
read, built only (launched once the verdict keeps every draft), or not at all.

A round looked ahead rests on the premise that this round keeps every draft; when it does
not, the round is discarded (`MtpDecoder.discard`). What that wins and costs depends on the
machine, so a decoder that decides (`pipeline=None`, on a GPU) times its first serial rounds:
`build`, the host's time from a round's start until it is queued on the device (drafting,
the verify pass, the verdict: graph building and kernel launches), and `wait`, the time the
host then blocks on the verdict. With `p` the smoothed share of rounds that keep every draft:

- built ahead, a kept round overlaps its build with the previous round's wait and wins
  `min(build, wait)`; a discarded one was built while the host had nothing else to do for
  `wait` of it and costs `max(0, build - wait)`. So a round is built ahead while
  `p * min(build, wait) > (1 - p) * max(0, build - wait)`: wherever the device is the slower
  one (`wait >= build`), and where the host is (a small model whose rounds are bound by
  launches), only while nearly every round keeps all its drafts. On an H100 the bundled
  example's depth-3 rounds (about half of them kept whole, its host the bottleneck) ran at
  1.15x stock built ahead and 1.31x serial (`bench/look_ahead_modes.py`);
- launched ahead, a kept round also overlaps its launches, which gains over building only
  where the host would still wait (`wait > build`), while a discarded one also occupies the
  device; so only there, and while `p >= PIPELINE_MIN_FULL`.

A round is looked ahead only after one of this generation has kept every draft (a useless
head's judging rounds were each built twice otherwise) and `TIMED_ROUNDS` serial rounds are
timed (the first ones carry first-use builds: the medians of the last `TIMING_WINDOW` serial
rounds are used).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# How a round is looked ahead (`MtpDecoder(pipeline=...)`): built and launched before this
# verdict is read, or built only and launched once the verdict keeps every draft.
LAUNCH_AHEAD, BUILD_AHEAD = "launch", "build"

# Launch ahead only while at least this share of rounds keeps every draft (exponentially
# smoothed over ~10 rounds). Measured on an H100 (qwen3_5-0.8b, depth 1, README
# "Performance"): a pipelined round that is kept costs ~0.87 of a serial one, a discarded
# one wastes ~1.3 serial rounds (its host time, and its kernels ahead of the real round), so
# at 83% fully kept rounds pipelining made rounds 11% slower; break-even is near 91%.
PIPELINE_MIN_FULL = 0.92
# Build ahead only while at least this share keeps every draft, and the timings say it pays
# (None: never). At 0.0 the timings alone decide: measured on an H100 (2026-11-25, `bash
# bench/gpu_bench.sh bench ab`, qwen3_5-4b with 8 layers, device-bound) building ahead won
# at every share: depth 1 at acceptance 0.8 1.00 -> 1.15x, depth 3 at 0.9 1.33 -> 1.48x.
BUILD_MIN_FULL: float | None = 0.0
FULL_SMOOTHING = 0.1
# The share before any round: just under the launch threshold, so that the first rounds wait
# for their verdicts and three full rounds in a row start launching ahead. From 1.0 the first
# round was launched ahead blind, and a useless head's first discard cost ~1.3 rounds of the
# few it drafts before adaptive drafting stops it (its target: >= 0.97 of stock).
FULL_SHARE_START = 0.9
TIMED_ROUNDS = 3  # serial rounds timed before any round is looked ahead
TIMING_WINDOW = 8  # serial rounds whose timings are kept (medians)


@dataclass
class LookAhead:
    """The look-ahead decision of one generation. `mode`: None decides (above); True always
    launches ahead, BUILD_AHEAD always builds ahead, False never looks ahead."""

    mode: bool | str | None = None
    timed: bool = True  # False: the share alone decides (ranks in lockstep, own clocks)
    full_share: float = FULL_SHARE_START  # smoothed share of rounds that kept every draft
    full_rounds: int = 0  # rounds that kept every draft
    builds: deque[float] = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))
    waits: deque[float] = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))

    def record_verdict(self, full: bool) -> None:
        """A round's verdict: whether it kept every draft."""
        self.full_share += FULL_SMOOTHING * (full - self.full_share)
        self.full_rounds += full

    def record_serial(self, build: float, wait: float) -> None:
        """A round that nothing was looked ahead of: seconds to queue it, then to its verdict."""
        self.builds.append(build)
        self.waits.append(wait)

    def choose(self) -> str | None:
        """LAUNCH_AHEAD, BUILD_AHEAD or None (the next round waits for this verdict)."""
        if self.mode is False:
            return None
        if self.mode is not None:
            return BUILD_AHEAD if self.mode == BUILD_AHEAD else LAUNCH_AHEAD
        if not self.full_rounds:
            return None
        if not self.timed:
            return look_ahead_by_share(self.full_share)
        if len(self.builds) < TIMED_ROUNDS:
            return None
        return look_ahead_by_cost(
            self.full_share, statistics.median(self.builds), statistics.median(self.waits)
        )


def look_ahead_by_share(p: float) -> str | None:
    """Without timings: launched ahead from PIPELINE_MIN_FULL, built ahead from BUILD_MIN_FULL."""
    if p >= PIPELINE_MIN_FULL:
        return LAUNCH_AHEAD
    return BUILD_AHEAD if BUILD_MIN_FULL is not None and p >= BUILD_MIN_FULL else None


def look_ahead_by_cost(p: float, build: float, wait: float) -> str | None:
    """The module's rule: the share `p` of rounds kept whole, a serial round's host `build`
    and its `wait` on the device."""
    if p >= PIPELINE_MIN_FULL and wait > build:
        return LAUNCH_AHEAD
    if BUILD_MIN_FULL is None or p < BUILD_MIN_FULL:
        return None
    gain = p * min(build, wait)
    loss = (1 - p) * max(0.0, build - wait)
    return BUILD_AHEAD if gain > loss else None
