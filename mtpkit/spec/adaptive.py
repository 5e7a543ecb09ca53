"""Adaptive drafting: draft while the head's yield pays for what a round costs, and decide
only from figures that are stable on a shared, noisy device.

A drafting round at depth K costs `r_K` plain steps and yields `1 + accepted` tokens, so it
pays while the head's yield (tokens per round, averaged over rounds) exceeds `r_K`. The two
figures:

- the yield is a count: the same on every run of the same text, whatever the machine's load;
- `r_K` comes from a prior per backend (`COST_PRIORS`, from the measured round and step
  costs that README "Performance" quotes). A greedy run, whose output never depends on these
  decisions, refines it by the wall clock once it has timed many rounds and plain steps
  (medians of the last 32 of each). A sampled run keeps the prior, so its decisions, and
  with `--seed` its text, are reproducible.

No decision draws a random number. The schedule: draft from the start and judge after
`FIRST_ROUNDS` rounds, then at every round on the last `WINDOW` rounds. While losing, plain
steps for a stretch (32 tokens, doubling to 1024; a head with no draft accepted at all:
256, doubling to 4096), then `RETRY_ROUNDS` rounds judged on their own; a win resets the
stretch. The plain steps of a stretch are queued one ahead, as stock mlx-lm's loop does.
"""

from __future__ import annotations

import statistics

import mlx.core as mx

FIRST_ROUNDS = 4
RETRY_ROUNDS = 3
WINDOW = 16
TIMED = 32  # wall-clock samples kept of each kind (greedy refinement)
MIN_TIMED = 8

# Round cost over a plain step at depth 1, and what each further depth adds. GPU (CUDA,
# Metal): a depth-1 round cost 1.05-1.12 plain steps on an H100 (qwen3_5 0.8b-9b, 4-bit,
# bench/profile_round.py), so 1.2 leaves a margin. CPU: a verify row costs about a full
# pass (README, "On this CPU MTP barely pays"), the bundled example's depth-1 rounds ~1.6.
COST_PRIORS = {"gpu": (1.2, 0.15), "cpu": (1.6, 0.6)}


def prior_cost(depth: int, device: str | None = None) -> float:
    kind = device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    base, per_depth = COST_PRIORS[kind]
    return base + per_depth * (depth - 1)


class AdaptiveDrafting:
    """Whether the next step drafts (see the module's text). `timed`: refine the round cost by
    the wall clock (greedy runs only); `cost`: the prior in plain steps (default: the
    backend's, `prior_cost`)."""

    def __init__(
        self, enabled: bool, depth: int = 1, *, timed: bool = False, cost: float | None = None
    ) -> None:
        self.enabled = enabled
        self.depth = depth
        self.timed = timed
        self.prior = prior_cost(depth) if cost is None else cost
        self.yields: list[int] = []  # tokens per round since drafting (re)started
        self.need = FIRST_ROUNDS
        self.plain_left = 0
        self.stretch = 32
        self.barren_stretch = 256
        self.any_accepted = False
        self.round_times: list[float] = []
        self.plain_times: list[float] = []
        self.after_rounds = False  # the next plain step carries the head's catch-up

    def want_draft(self) -> bool:
        return not self.enabled or self.plain_left <= 0

    def plain_ahead(self) -> int:
        """Plain steps certain to follow the current one (read before recording it)."""
        return max(0, self.plain_left - 1) if self.enabled else 0

    def cost(self) -> float:
        """Round cost in plain steps: the prior, or (timed) the medians' ratio."""
        if self.timed and min(len(self.round_times), len(self.plain_times)) >= MIN_TIMED:
            plain = statistics.median(self.plain_times)
            if plain > 0:
                return statistics.median(self.round_times) / plain
        return self.prior

    def record_plain(self, seconds: float) -> None:
        if not self.enabled:
            return
        if self.timed and not self.after_rounds:
            self.plain_times = (self.plain_times + [seconds])[-TIMED:]
        self.after_rounds = False
        self.plain_left -= 1

    def record_round(self, emitted: int, seconds: float = 0.0) -> None:
        """A drafting round yielded `emitted` tokens (1 + drafts accepted)."""
        if not self.enabled:
            return
        self.after_rounds = True
        self.any_accepted |= emitted > 1
        if self.timed:
            self.round_times = (self.round_times + [seconds])[-TIMED:]
        self.yields = (self.yields + [emitted])[-WINDOW:]
        if len(self.yields) < self.need:
            return
        if sum(self.yields) / len(self.yields) >= self.cost():
            self.stretch = 32
            self.need = 1  # judged from now on at every round, on the last WINDOW
            return
        if self.any_accepted:
            self.plain_left = self.stretch
            self.stretch = min(self.stretch * 2, 1024)
        else:
            self.plain_left = self.barren_stretch
            self.barren_stretch = min(self.barren_stretch * 2, 4096)
        self.yields = []
        self.need = RETRY_ROUNDS
