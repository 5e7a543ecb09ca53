"""Adaptive drafting: draft while the head's yield pays for what a round costs, at the depth
that pays best, and decide only from figures that are stable on a shared, noisy device.

A drafting round at depth K costs `r_K` plain steps and yields `1 + accepted` tokens, so it
pays while the head's yield (tokens per round, averaged over rounds) exceeds `r_K`. The two
figures:

- the yield is a count: the same on every run of the same text, whatever the machine's load;
- `r_K` comes from a prior per backend (`COST_PRIORS`, from the measured round and step
  costs that README "Performance" quotes). A greedy run, whose output never depends on these
  decisions, refines it by the wall clock once it has timed many rounds and plain steps
  (the lower quartiles of the last 32 of each, `steady`: a shared device's noise only ever
  slows a step). A sampled run keeps the prior, so its decisions, and with `--seed` its
  text, are reproducible.

No decision draws a random number. The schedule: draft from the start and judge after
`FIRST_ROUNDS` rounds, then at every round on the last `WINDOW` rounds. While losing, plain
steps for a stretch (32 tokens, doubling to 1024; a head with no draft accepted at all:
256, doubling to 4096), then `RETRY_ROUNDS` rounds judged on their own; a win resets the
stretch. The plain steps of a stretch are queued one ahead, as stock mlx-lm's loop does.
After `PARK_LOSSES` losing decisions, or `PARK_CLEAR` clear ones (rounds that kept no draft
at all), drafting is parked, as omlx parks MTP: `PARKED_STRETCH` plain steps between
retries, doubling to `MAX_PARKED_STRETCH`, until a retry wins. A greedy session keeps a
clear verdict for the next request (`DraftingMemory`, on the engine): a head that is parked,
or that lost without a draft ever kept, goes on where its stretch stood, instead of judging
every request's first rounds afresh.

Choosing the depth (`choose_depth`, the default of `generate` without `--depth`): a round at
depth K yields E_K = 1 + a_1 + a_1 a_2 + ... (K terms) tokens for r_K plain steps, and the next
rounds draft at the K of the largest E_K / r_K, starting at depth 1. a_j, the head's
acceptance at its j-th draft given the drafts before it kept, is counted over the last
`OBSERVED` drafts: the first draft's in every round; a later one's in the rounds at depth K
once they have judged it `MIN_OBSERVED` times (a text's period can make it depend on the
round's depth: the bundled example keeps its second draft 98% of the time in depth-2 rounds,
62% in depth-3 ones), before that in rounds no deeper than K, and unseen it borrows the one
before it, so a depth that might pay is tried. Every `PROBE_EVERY` rounds one round goes one
deeper or one shallower, in turn, so that a depth's counts are renewed; a probe that does
not win its depth doubles the rounds before the next one that way (up to `MAX_PROBE_EVERY`);
a deeper probe that kept every draft, or a change of depth, resets them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx

FIRST_ROUNDS = 4
RETRY_ROUNDS = 3
WINDOW = 16
TIMED = 32  # wall-clock samples kept of each kind (greedy refinement)
MIN_TIMED = 8
AUTO_MAX_DEPTH = 3  # the deepest depth adaptive drafting chooses when no depth is given
OBSERVED = 32  # verdicts kept per round depth and draft
MIN_OBSERVED = 4
PROBE_EVERY = 32
MAX_PROBE_EVERY = 512  # rounds between probes of a neighbour depth that keeps losing
PARK_LOSSES = 16  # losing decisions since the last win that park drafting (omlx's count)
PARK_CLEAR = 4  # or clear losses: decisions on rounds that kept no draft at all
PARKED_STRETCH = 4096  # plain steps between the retries of parked drafting, doubling to
MAX_PARKED_STRETCH = 32768

# Round cost over a plain step at depth 1, and what each further depth adds. GPU (CUDA,
# Metal): on an H100 (2026-11-25, `mtpkit bench --random`, qwen3_5 0.8b-9b and the 35B MoE
# at 8 layers, 4-bit, rounds built ahead) rounds at acceptance 0.9 cost 1.10-1.49 stock
# steps at depth 1 and 0.12-0.65 more per further depth; the bundled example's rounds
# (launch-bound) 1.85 / 2.1 / 2.7. CPU: a verify row costs about a full pass (README, "On
# this CPU MTP barely pays"), the bundled example's depth-1 rounds ~1.6.
COST_PRIORS = {"gpu": (1.3, 0.25), "cpu": (1.6, 0.6)}


STEADY_QUANTILE = 0.25


def steady(seconds: Iterable[float]) -> float:
    """What a kind of step costs when it runs on: the lower quartile of its timings. Stalls
    on a shared device (first-use kernel builds, another tenant's burst, a collection) only
    ever add time, so a low quantile is stable where a median still moves with them."""
    ordered = sorted(seconds)
    return ordered[int(STEADY_QUANTILE * (len(ordered) - 1))]


def prior_cost(depth: int, device: str | None = None) -> float:
    kind = device or ("gpu" if mx.default_device() == mx.gpu else "cpu")
    base, per_depth = COST_PRIORS[kind]
    return base + per_depth * (depth - 1)


def resolve_depth(depth: int | None, adaptive: bool) -> tuple[int, bool]:
    """(the deepest depth a round drafts, whether adaptive drafting chooses it) for a `depth`
    given or not (None: chosen up to `AUTO_MAX_DEPTH` when adaptive, else 1)."""
    if depth is not None:
        return depth, False
    return (AUTO_MAX_DEPTH, True) if adaptive else (1, False)


def expected_tokens(acceptance: list[float | None]) -> float:
    """E_K, the tokens a round yields at depth K = len(acceptance) given each draft's
    acceptance (None: never judged, 0): 1 + a_1 + a_1 a_2 + ..."""
    total, kept = 1.0, 1.0
    for a in acceptance:
        kept *= a or 0.0
        total += kept
    return total


# The schedule's state a losing verdict leaves (`DraftingMemory`).
SCHEDULE = ("plain_left", "stretch", "barren_stretch", "parked_stretch", "losses",
            "clear_losses", "parked", "any_accepted")  # fmt: skip


@dataclass
class DraftingMemory:
    """What one greedy request's adaptive drafting leaves the next of the same engine and
    drafter: the schedule after a clear losing verdict (stretches, losses, parked, the plain
    steps left), or None (the next request judges its first rounds afresh)."""

    schedule: dict[str, int | bool] | None = None


class AdaptiveDrafting:
    """Whether the next step drafts, and at which depth (see the module's text). `depth`: the
    depth of every round, or with `choose_depth` the deepest; `timed`: refine the round cost
    by the wall clock (greedy runs only); `cost`: the prior in plain steps at `depth`
    (default: the backend's, `prior_cost`); `priors`: a proposer's own per depth."""

    def __init__(
        self,
        enabled: bool,
        depth: int = 1,
        *,
        timed: bool = False,
        cost: float | None = None,
        choose_depth: bool = False,
        priors: dict[int, float | None] | None = None,
    ) -> None:
        self.enabled = enabled
        self.max_depth = depth
        self.choose = enabled and choose_depth
        self.depth = 1 if self.choose else depth  # of the next round
        self.timed = timed
        self.priors = {k: prior_cost(k) for k in range(1, depth + 1)}
        # A proposer's own costs (a draft model's steps), where it knows them.
        self.priors.update({k: v for k, v in (priors or {}).items() if v is not None})
        if cost is not None:
            self.priors[depth] = cost
        self.yields: list[int] = []  # tokens per round since drafting (re)started
        self.need = FIRST_ROUNDS
        self.plain_left = 0
        self.stretch = 32
        self.barren_stretch = 256
        self.any_accepted = False
        self.round_times: dict[int, list[float]] = {}
        self.plain_times: list[float] = []
        self.after_rounds = False  # the next plain step carries the head's catch-up
        # By the depth of the round, then by the draft's depth: 1 kept, 0 rejected.
        self.observed: dict[int, dict[int, list[int]]] = self._fresh()
        self.since_probe = 0
        self.probe_deeper = True
        self.probe_every = {1: PROBE_EVERY, -1: PROBE_EVERY}  # rounds, by the probe's direction
        self.losses = 0  # losing decisions since the last win
        self.clear_losses = 0  # of them, those on rounds that kept no draft at all
        self.parked = False
        self.parked_stretch = PARKED_STRETCH

    def _fresh(self) -> dict[int, dict[int, list[int]]]:
        return {k: {j: [] for j in range(1, k + 1)} for k in self.priors}

    def want_draft(self) -> bool:
        return not self.enabled or self.plain_left <= 0

    @property
    def resting(self) -> bool:
        """Whether the proposer may let go of what it keeps only to draft well at the next
        retry: drafting is parked, or paused and no draft was ever kept."""
        return self.enabled and (self.parked or (self.plain_left > 0 and not self.any_accepted))

    def next_depth(self) -> int:
        """The depth of the next drafting round: the chosen one, or a neighbour to probe
        (deeper or shallower in turn, each once its own interval of rounds has passed)."""
        if not self.choose:
            return self.depth
        for step in (1, -1) if self.probe_deeper else (-1, 1):
            due = self.since_probe >= self.probe_every[step]
            if due and 1 <= self.depth + step <= self.max_depth:
                return self.depth + step
        return self.depth

    def plain_ahead(self) -> int:
        """Plain steps certain to follow the current one (read before recording it)."""
        return max(0, self.plain_left - 1) if self.enabled else 0

    def cost(self, depth: int | None = None) -> float:
        """Round cost at `depth` in plain steps: the prior, or (timed) the ratio of the steady
        costs (`steady`)."""
        depth = depth or self.depth
        rounds = self.round_times.get(depth, [])
        if self.timed and min(len(rounds), len(self.plain_times)) >= MIN_TIMED:
            plain = steady(self.plain_times)
            if plain > 0:
                return steady(rounds) / plain
        return self.priors[depth]

    def acceptance(self, depth: int | None = None) -> list[float]:
        """The acceptance of a round at `depth` (default: the deepest) at each of its drafts,
        given the drafts before it kept: the first draft's counted in every round; a later
        one's in rounds at `depth` once they judged it MIN_OBSERVED times, else in rounds no
        deeper than `depth`, else borrowed from the draft before it."""
        depth = depth or self.max_depth
        out: list[float] = []
        for j in range(1, depth + 1):
            if j == 1:
                seen = [x for k in self.priors for x in self.observed[k][1]]
            else:
                seen = self.observed[depth][j]
                if len(seen) < MIN_OBSERVED:
                    seen = [x for k in range(j, depth + 1) for x in self.observed[k][j]]
            enough = len(seen) >= (1 if j == 1 else MIN_OBSERVED)
            out.append(sum(seen) / len(seen) if enough else (out[-1] if out else 1.0))
        return out

    def expected(self, depth: int) -> float:
        """Tokens a round at `depth` yields, estimated from the counts (`acceptance`)."""
        return expected_tokens(self.acceptance(depth))

    def best_depth(self) -> tuple[int, float]:
        """The depth whose rounds pay best, and their tokens per plain step's cost."""
        values = {k: self.expected(k) / self.cost(k) for k in self.priors}
        best = max(values, key=lambda k: (values[k], -k))
        return best, values[best]

    def record_plain(self, seconds: float) -> None:
        if not self.enabled:
            return
        if self.timed and not self.after_rounds:
            self.plain_times = (self.plain_times + [seconds])[-TIMED:]
        self.after_rounds = False
        self.plain_left -= 1

    def record_round(self, emitted: int, seconds: float = 0.0, depth: int | None = None) -> None:
        """A drafting round at `depth` (default: the current one) yielded `emitted` tokens
        (1 + drafts accepted)."""
        if not self.enabled:
            return
        depth = depth or self.depth
        accepted = emitted - 1
        seen = self.observed[depth]
        for j in range(1, min(accepted + 1, depth) + 1):  # the drafts that were judged
            seen[j] = (seen[j] + [int(j <= accepted)])[-OBSERVED:]
        # A probe's direction (0: a round at the chosen depth; a proposer may also have
        # found fewer drafts than asked, as prompt lookup does).
        probed = (depth > self.depth) - (depth < self.depth)
        if probed:  # the next probe goes the other way
            self.since_probe, self.probe_deeper = 0, probed < 0
        else:
            self.since_probe += 1
        self.after_rounds = True
        self.any_accepted |= emitted > 1
        if self.timed:
            self.round_times[depth] = (self.round_times.get(depth, []) + [seconds])[-TIMED:]
        self.yields = (self.yields + [emitted])[-WINDOW:]
        if len(self.yields) >= self.need:
            self._judge(probed, accepted == depth)

    def _judge(self, probed: int, kept_all: bool) -> None:
        """Whether drafting pays on the window's rounds (and at which depth); else a stretch
        of plain steps (`_lose`). `probed`: the last round probed a depth that way;
        `kept_all`: it kept every draft."""
        if self.choose:
            chosen, value = self.best_depth()
            if chosen != self.depth:  # probes count from a change of depth
                self.depth, self.since_probe = chosen, 0
                self.probe_every = {1: PROBE_EVERY, -1: PROBE_EVERY}
            elif probed > 0 and kept_all:  # its deepest draft kept: the depth may yet pay
                self.probe_every[probed] = PROBE_EVERY
            elif probed:  # the probed depth lost: probe that way less often
                self.probe_every[probed] = min(2 * self.probe_every[probed], MAX_PROBE_EVERY)
            pays = value >= 1.0
        else:
            pays = sum(self.yields) / len(self.yields) >= self.cost()
        if not pays:
            self._lose()
            return
        self.stretch = 32
        self.need = 1  # judged from now on at every round, on the last WINDOW
        self.losses = self.clear_losses = 0
        self.parked, self.parked_stretch = False, PARKED_STRETCH

    def _lose(self) -> None:
        """A losing decision: plain steps for a stretch, then a retry judged on its own."""
        self.losses += 1
        self.clear_losses += all(emitted == 1 for emitted in self.yields)
        if self.parked or self.losses >= PARK_LOSSES or self.clear_losses >= PARK_CLEAR:
            self.parked = True
            self.plain_left = self.parked_stretch
            self.parked_stretch = min(self.parked_stretch * 2, MAX_PARKED_STRETCH)
        elif self.any_accepted:
            self.plain_left = self.stretch
            self.stretch = min(self.stretch * 2, 1024)
        else:
            self.plain_left = self.barren_stretch
            self.barren_stretch = min(self.barren_stretch * 2, 4096)
        self.yields = []
        self.observed = self._fresh()  # the retry is judged on its own
        self.need = RETRY_ROUNDS

    def resume(self, memory: DraftingMemory) -> None:
        """Go on from the losing verdict an earlier request left (`DraftingMemory`): the
        rest of its stretch in plain steps, then a retry judged on RETRY_ROUNDS rounds."""
        if not self.enabled or memory.schedule is None:
            return
        for name, value in memory.schedule.items():
            setattr(self, name, value)
        self.need = RETRY_ROUNDS

    def remember(self, memory: DraftingMemory) -> None:
        """Leave `memory` this request's verdict: the schedule if it is a clear loss (parked,
        or losing without a draft ever kept), else None. A head that kept some drafts and
        still lost is judged afresh on the next request: its text (or its logits
        processors) may suit the head better."""
        if self.enabled:
            clear = self.parked or (self.losses > 0 and not self.any_accepted)
            memory.schedule = {name: getattr(self, name) for name in SCHEDULE} if clear else None
