"""Drafting decided per batch width: a width whose rounds cost more per token than plain
batched steps decodes plainly.

A drafting round over B rows verifies B x (K+1) positions and yields the rows' kept drafts
plus one token each; a plain step yields B tokens. Which is cheaper per token depends on the
width (at 9b MLX's quantized matmul grows with the rows, issue 30's baseline) and on the
rows' acceptance, so the choice is measured: at each width, seconds per confirmed token of
the last `KEPT` rounds and of the last `KEPT` plain steps. A width drafts its first
`FIRST_ROUNDS` rounds, then takes `PROBE_STEPS` plain steps, then the cheaper mode, and every
`REPROBE_EVERY` steps probes the other one for `PROBE_STEPS` steps, so a change of acceptance
or of load is seen. Greedy output never depends on these decisions (every mode decodes the
backbone's tokens); a seeded sampled row's text does, through the draws each mode takes.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

FIRST_ROUNDS = 4
PROBE_STEPS = 4
REPROBE_EVERY = 32
KEPT = 16


@dataclass
class WidthTimes:
    """One width's seconds per token, drafting and plain, and its steps since it was judged."""

    drafting: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    plain: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    steps: int = 0


class WidthDrafting:
    """Whether the next step at a batch width drafts (see the module's text)."""

    def __init__(self) -> None:
        self.widths: dict[int, WidthTimes] = {}

    def want_draft(self, width: int) -> bool:
        times = self.widths.setdefault(width, WidthTimes())
        if len(times.drafting) < FIRST_ROUNDS:
            return True
        if len(times.plain) < PROBE_STEPS:
            return False
        times.steps += 1
        drafting_wins = statistics.median(times.drafting) <= statistics.median(times.plain)
        probing = times.steps % REPROBE_EVERY < PROBE_STEPS
        return drafting_wins != probing

    def record(self, width: int, drafted: bool, seconds: float, tokens: int) -> None:
        """A step at `width` took `seconds` for `tokens` confirmed tokens (over every row)."""
        if tokens <= 0:
            return
        times = self.widths.setdefault(width, WidthTimes())
        (times.drafting if drafted else times.plain).append(seconds / tokens)
