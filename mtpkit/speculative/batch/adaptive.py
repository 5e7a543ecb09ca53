"""Drafting decided per batch width: a width whose rounds cost more per token than plain
batched steps decodes plainly.

A drafting round over B rows verifies B x (K+1) positions and yields the rows' kept drafts
plus one token each; a plain step yields B tokens. Which is cheaper per token depends on the
width (at 9b MLX's quantized matmul grows with the rows, issue 30's baseline) and on the
rows' acceptance, so the choice is measured, at each width, from two kinds of figures kept
apart:

- what a round and a plain step cost, in seconds: the lower quartile (`steady`) of the last
  `KEPT` of each. A shared device's noise only ever slows a step (a first-use kernel build,
  another tenant's burst, a collection, a mode's first step that nothing was queued ahead
  of), so a low quantile is what the mode costs when it runs on, and a few stalls in a
  width's first rounds do not send it to plain steps for the rest of its run;
- what a round yields, in tokens: the mean of the last `KEPT` rounds' counts (the rows'
  acceptance, the same on every machine), and what a plain step yields (its rows).

A width drafts its first `FIRST_ROUNDS` rounds, then takes `PROBE_STEPS` plain steps, then
the cheaper mode per token, and probes the other mode for `PROBE_STEPS` steps from time to
time, so a change of acceptance or of load is seen. The first probe comes `REPROBE_EVERY`
steps after a choice, and each probe that leaves the choice as it was doubles the wait, up to
`MAX_REPROBE_EVERY`, as one stream's adaptive drafting does (`speculative/adaptive.py`); a
width whose recent rounds kept no draft at all (a useless head) waits `USELESS_EVERY` steps
from the start. A probe costs a losing mode's price, so at acceptance 0 the probes are what
adaptive drafting loses against plain decoding. `REPROBE_EVERY` is 16 (was 32): a first choice
taken while the machine was slow for one mode's samples is looked at again sooner; 8 would
add a probe's plain steps to every short request where rounds win (by count, about 5% of a
128-token request at acceptance 0.8; not measured).

A width met after another was judged (rows leave a batch one by one) first takes the nearest
judged width's choice, for as many steps as that width waits between its probes, and only
then explores on its own (on an H100 at 128 tokens a row, 15-28% of adaptive drafting's
steps were plain at acceptance 0.8, where every round pays; each width of a shrinking batch
explored anew, with 4 plain steps, was part of that).

Greedy output never depends on these decisions (every mode decodes the backbone's tokens); a
seeded sampled row's text does, through the draws each mode takes.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from mtpkit.speculative.adaptive import steady

FIRST_ROUNDS = 4
PROBE_STEPS = 4
REPROBE_EVERY = 16
MAX_REPROBE_EVERY = 1024
USELESS_EVERY = 256
KEPT = 16


@dataclass
class WidthTimes:
    """One width's seconds per step and tokens per step, drafting and plain, and its probe
    schedule (in steps judged at this width)."""

    drafting: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    yields: deque[int] = field(default_factory=lambda: deque(maxlen=KEPT))  # a round's tokens
    plain_yields: deque[int] = field(default_factory=lambda: deque(maxlen=KEPT))
    steps: int = 0
    borrowed: int = 0  # steps taken on another width's choice before judging its own
    choice: bool | None = None  # drafting wins, as last judged
    every: int = REPROBE_EVERY  # steps from the last probe's start to the next's
    probe_at: int = 0  # the step the next probe starts at

    def per_token(self, *, drafting: bool) -> float:
        """Seconds per confirmed token of a mode: its steady step cost over its mean yield."""
        seconds, tokens = (
            (self.drafting, self.yields) if drafting else (self.plain, self.plain_yields)
        )
        return steady(seconds) / statistics.fmean(tokens)


class WidthDrafting:
    """Whether the next step at a batch width drafts (see the module's text). `times_kind`:
    what keeps and judges a width's figures (bench's A/B swaps the judge)."""

    times_kind: type[WidthTimes] = WidthTimes

    def __init__(self) -> None:
        self.widths: dict[int, WidthTimes] = {}

    def _times(self, width: int) -> WidthTimes:
        return self.widths.setdefault(width, self.times_kind())

    def want_draft(self, width: int) -> bool:
        times = self._times(width)
        if len(times.drafting) < FIRST_ROUNDS or len(times.plain) < PROBE_STEPS:
            nearest = self._nearest_judged(width)
            if nearest is not None and times.borrowed < nearest.every:
                times.borrowed += 1
                return bool(nearest.choice)
            return len(times.drafting) < FIRST_ROUNDS  # its first rounds, then plain probes
        times.steps += 1
        drafting_wins = times.per_token(drafting=True) <= times.per_token(drafting=False)
        if drafting_wins != times.choice:  # a new choice: its first probe comes soon
            times.choice = drafting_wins
            kept_any = any(tokens > width for tokens in times.yields)
            times.every = REPROBE_EVERY if kept_any else USELESS_EVERY
            times.probe_at = times.steps + times.every
        elif times.steps >= times.probe_at + PROBE_STEPS:  # a probe left the choice as it was
            times.every = min(2 * times.every, MAX_REPROBE_EVERY)
            times.probe_at += times.every
        probing = times.steps >= times.probe_at
        return drafting_wins != probing

    def _nearest_judged(self, width: int) -> WidthTimes | None:
        """The judged width nearest `width` (the wider one of two as near), if any."""
        judged = [w for w, t in self.widths.items() if t.choice is not None and w != width]
        if not judged:
            return None
        return self.widths[min(judged, key=lambda w: (abs(w - width), -w))]

    def record(self, width: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A step at `width` took `seconds` for `tokens` confirmed tokens (over every row); a
        drafting round that confirmed more tokens than rows kept a draft."""
        if tokens <= 0:
            return
        times = self._times(width)
        (times.drafting if drafted else times.plain).append(seconds)
        (times.yields if drafted else times.plain_yields).append(tokens)
