"""Oracle drafts for `mtpkit bench --acceptance A` and `mtpkit serve --oracle-acceptance A`:
a controlled acceptance at a real shape.

The head still runs and costs what it costs, but the token it drafts at each depth is
replaced: by the backbone's own next token, taken from a plain greedy pass over the same
prompt (so the verify pass keeps it) where the plan says right, else by a wrong one. The
plan: round r keeps its draft at depth j when a seeded golden-ratio (Weyl) sequence, one per
depth, is below A at r, so that even a 128-token run realizes A closely (independent draws
at A = 0.8 realized 0.75 over 73 rounds; the same sequence over positions realized 0.73,
since a kept draft skips a position). r counts the rounds whose verdict is read, so a
pipelined round that is queued and discarded takes no place in it.

The verdict is held to the plan too (`read_verdict`): a random-weight model's logits are
nearly tied, so its multi-token verify pass and stock's one-token steps part ways within a
few tokens on a GPU (bf16), after which no reference token would be accepted again. The
round keeps exactly the planned drafts and the backbone's token after them, so the verify
pass, the rollback and the head's steps cost what a head of acceptance A costs. Figures
measured so are synthetic: what a head of that acceptance would gain, not what any head does.

A request may carry its plan (`Request.oracle`, an `Oracle`: the reference, A, a seed): one
stream's session then drafts through `OracleProposer`, a batch's row through `RowOracle`
(`BatchSession`), so the server's own paths are measured (`mtpkit serve --oracle-acceptance`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import Proposal, Proposer

GOLDEN = (5**0.5 - 1) / 2  # the Weyl sequence's step: the most evenly spread


@dataclass(frozen=True)
class Oracle:
    """A request's oracle drafts (see the module's text): right at a share `acceptance` at
    each depth over `reference`, the prompt's greedy continuation (its EOS included where one
    ended it), by the plan `seed` picks. Each decode makes its own plan of it (`plan`)."""

    reference: tuple[int, ...]
    acceptance: float
    seed: int = 0

    def plan(self, prompt_length: int, vocab: int) -> OracleDrafts:
        return OracleDrafts(list(self.reference), prompt_length, self.acceptance, vocab, self.seed)


class OracleDrafts:
    """The plan: right at a share `acceptance` at each depth. As a draft filter
    (`MtpDecoder.draft_filter`) it replaces drafts by position; `proposer` wraps a real
    proposer so that the verdict is held to the plan too (`OracleProposer`)."""

    def __init__(
        self, reference: list[int], prompt_length: int, acceptance: float, vocab: int, seed: int = 0
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], not {acceptance}")
        self.reference = reference  # the greedy continuation of the prompt
        self.prompt_length = prompt_length
        self.acceptance = acceptance
        self.vocab = vocab
        self.seed = seed
        self.rounds = 0  # verdicts read so far
        self.offsets: dict[int, float] = {}  # each depth's sequence's start, by its seed

    def planned(self, round_index: int, depth: int) -> int:
        """Drafts planned right, in a row, for the `round_index`-th round read."""
        kept = 0
        while kept < depth and self.right(round_index, kept):
            kept += 1
        return kept

    def judge(self, verdict: Verdict) -> Verdict:
        """The next round read keeps the planned count and the backbone's token after it."""
        held = verdict.holding(self.planned(self.rounds, len(verdict.drafts)))
        self.rounds += 1
        return held

    def right(self, round_index: int, depth: int) -> bool:
        offset = self.offsets.get(depth)
        if offset is None:  # seeded once: a served batch asks every row's, every round
            offset = self.offsets[depth] = random.Random(f"{self.seed}:{depth}").random()
        return (offset + round_index * GOLDEN) % 1.0 < self.acceptance

    def __call__(self, position: int, head_drafts: mx.array) -> mx.array:
        start = position - self.prompt_length
        drafts = []
        for j in range(head_drafts.shape[0]):
            i = start + j
            truth = self.reference[i] if i < len(self.reference) else 0
            drafts.append(truth if self.right(self.rounds, j) else (truth + 1) % self.vocab)
        # The proposer's drafts stay in the graph (never negative): its cost is paid.
        return mx.where(head_drafts < 0, head_drafts, mx.array(drafts, dtype=mx.int32))

    def proposer(self, inner: Proposer) -> OracleProposer:
        return OracleProposer(inner, self)

    def for_rows(self) -> RowOracle:
        return RowOracle(self)


class RowOracle:
    """The plan for one row of a batch, by rounds built (a batched round may be built before
    the round before it is read, so the position of its drafts is on the device): its drafts
    (`drafts`, a `BatchDecoder.draft_filter`) and its verdict's count (`planned`, a
    `BatchDecoder.plan`), asked in that order once per round."""

    def __init__(self, plan: OracleDrafts) -> None:
        self.plan = plan
        self.built = 0
        self.reference = mx.array([*plan.reference, 0], dtype=mx.int32)

    def drafts(self, position: mx.array, head_drafts: mx.array) -> mx.array:
        k = head_drafts.shape[0]
        at = position - self.plan.prompt_length + mx.arange(k)
        truth = self.reference[mx.clip(at, 0, self.reference.shape[0] - 1)]
        right = mx.array([self.plan.right(self.built, j) for j in range(k)])
        planned = mx.where(right, truth, (truth + 1) % self.plan.vocab)
        # The proposer's drafts stay in the graph (never negative): its cost is paid.
        return mx.where(head_drafts < 0, head_drafts, planned.astype(mx.int32))

    def planned(self, depth: int) -> int:
        kept = self.plan.planned(self.built, depth)
        self.built += 1
        return kept


class OracleProposer:
    """`inner` drafting as usual (its cost paid), its drafts replaced by the plan's and its
    verdicts held to it. It keeps the position of the next round's first draft itself: the
    confirmed tokens of plain steps and rounds, or a look-ahead round's premise."""

    def __init__(self, inner: Proposer, plan: OracleDrafts) -> None:
        self.inner, self.plan = inner, plan
        self.name, self.looks_ahead = inner.name, inner.looks_ahead
        self.drafts_locally = inner.drafts_locally
        self.position = 0
        self.premise: int | None = None  # a look-ahead round's position
        self.prefilling = False

    def caches(self) -> list[Any]:
        return self.inner.caches()

    def attach(self, cache: list[Any]) -> None:
        self.inner.attach(cache)

    def begin(self, prompt: list[int], cached: int) -> None:
        self.position, self.premise, self.prefilling = len(prompt), None, True
        self.inner.begin(prompt, cached)

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        if not self.prefilling:
            self.position += len(tokens)
        self.inner.observe(hidden, tokens)

    def end_prefill(self) -> None:
        self.prefilling = False
        self.inner.end_prefill()

    def defers_catch_up(self) -> bool:
        return self.inner.defers_catch_up()

    def can_propose(self) -> bool:
        return self.inner.can_propose()

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal | None:
        proposal = self.inner.propose(depth, sampling)
        if proposal is None:
            return None
        position = self.position if self.premise is None else self.premise
        return Proposal(self.plan(position, proposal.drafts), proposal.dists)

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> tuple[Any, int]:
        return self.inner.after_verify(proposal, hidden, followers, launch), proposal.depth

    def assume_kept(self, state: tuple[Any, int]) -> None:
        self.premise = self.position + state[1] + 1
        self.inner.assume_kept(state[0])

    def discard(self, state: tuple[Any, int], launched: bool) -> None:
        self.inner.discard(state[0], launched)

    def settle(self, state: tuple[Any, int], verdict: Verdict, premise_held: bool) -> None:
        self.position += len(verdict.confirmed)
        self.premise = None
        self.inner.settle(state[0], verdict, premise_held)

    def judged(self, verdict: Verdict) -> Verdict:
        return self.plan.judge(self.inner.judged(verdict))

    def rest(self, parked: bool) -> None:
        self.inner.rest(parked)

    def cost_prior(self, depth: int) -> float | None:
        return self.inner.cost_prior(depth)

    def fork(self) -> Proposer:
        """The drafter's own state (a prompt cache's entry): a later request of the same
        prefix drafts by its own plan, or by the head."""
        return self.inner.fork()
