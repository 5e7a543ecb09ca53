"""A batched drafting round, built, then read: every row's drafts, the verify pass over
`[B, K+1]`, each row's verdict, and (for a round built ahead) each row's rollback on the
device.

A round read at once (`build_round(..., ahead=False)`, then the decoder reads its verdicts and
rolls each row back by the counts it read) leaves the device idle while the host builds the
next. A round built ahead (`ahead=True`, for a drafter that `rolls_on_device`: the head)
needs no host read to be rolled back: each row's
accepted count is computed on the device from its packed verdict (`accept.accepted_counts`, or the
count a `plan` holds it to), every cache rolls each row back by it (`BatchVerifyPass.
rollback_on_device`, `RowsProposer.settle_on_device`), and the next round's input token and
positions are gathered on the device too. So the decoder builds and launches round n+1 on
round n's lazy results, then reads round n's verdicts while the device runs round n+1, as
mlx-lm queues its plain batched steps one ahead. A row that round n ends (an EOS, its
`max_tokens`, a cancel) was built into round n+1 anyway: its share of that round is discarded
when the round is read, and it leaves the batch after. With a prompt cache, its entry is taken
as a round read first leaves it (`ended_row_entry`): its KV entries past its end trimmed, its
gated-delta-net states and the drafter's state taken from the round that ended it
(`RowsProposer.take_ended`).

A KV cache rolled on the device is never trimmed: a round's rejected entries stay in the
buffer as the row's left padding (masked, never attended), so a row's cache grows by K+1
entries a round rather than by what it kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from mtpkit.runtime.model import MtpModel
from mtpkit.runtime.rollback.gdn import is_recurrent_cache, state_after
from mtpkit.runtime.rollback.verify_rows import BatchVerifyPass, verify_rows
from mtpkit.speculative.accept import SamplingSettings, Verdict, accepted_counts, verdict_of
from mtpkit.speculative.batch.draws import round_keys, row_verdicts
from mtpkit.speculative.batch.row import Row
from mtpkit.speculative.proposers import Proposer, RowsProposal, RowsProposer

# A draft filter: (the row, the position of its round's first draft in prompt + output, on
# the device: a round built ahead is built before the round before it is read, the
# drafter's drafts for it [K]) -> the drafts to verify [K] (tests' injected drafts, bench's
# oracle).
RowDraftFilter = Callable[[Row, mx.array, mx.array], mx.array]
# A plan: (the row, its drafts this round) -> how many of them its verdict keeps, whatever
# the verify pass says (the oracle holds a random-weight model to its plan, as
# `OracleProposer.judged` does for one stream), or None: what the verify pass says (a row
# without a plan); asked once per round built, in order.
RowPlan = Callable[[Row, int], int | None]


class Batch(Protocol):
    """What a round is built over (a `BatchDecoder`): the model, the rows in the batch's
    order, the drafter's batched state, the backbone's batched caches and the test or bench
    hooks."""

    m: MtpModel
    rows: list[Row]
    proposer: RowsProposer
    cache: list[Any]
    draft_filter: RowDraftFilter | None
    plan: RowPlan | None


@dataclass
class BuiltRound:
    """A round built (and launched): what reading it and rolling it back need."""

    rows: list[Row]  # the batch's rows as it was built, in its row order
    samplings: list[SamplingSettings]
    proposal: RowsProposal  # each row's drafts and the count of them it verifies
    packs: list[mx.array]  # each row's packed verdict (lazy)
    verified: BatchVerifyPass
    state: Any  # the drafter's work over the verified pairs (`RowsProposer.after_verify`)
    planned: list[int | None] | None  # each row's count as its plan holds it, if planned
    # Built ahead: each row's accepted drafts [B], next input token [B, 1] and position (lazy).
    accepted: mx.array | None = None
    last: mx.array | None = None
    positions: mx.array | None = None

    def verdicts(self) -> list[Verdict]:
        """Each row's verdict, read to the host (the round's one read), held to the plan."""
        mx.eval(self.packs)
        verdicts = [
            verdict_of(p.tolist(), s.greedy) for p, s in zip(self.packs, self.samplings, strict=True)
        ]
        if self.planned is not None:
            verdicts = [
                v if n is None else v.holding(n)
                for v, n in zip(verdicts, self.planned, strict=True)
            ]
        return verdicts

    def take(self, index: mx.array) -> None:
        """Keep the built-ahead inputs of the batch rows `index` (rows left the batch)."""
        if self.last is not None:
            self.last, self.positions = self.last[index], self.positions[index]


def build_round(batch: Batch, last: mx.array, positions: mx.array, *, ahead: bool) -> BuiltRound:
    """Draft, verify and judge one round over every row of `batch` from each row's input
    token `last` [B, 1] and `positions` [B] (the first draft's position in prompt + output),
    and launch it; `ahead`: roll each row back on the device too where every cache and the
    drafter can be (see the module's text; else `last` is None: the decoder rolls back what
    it reads)."""
    rows, proposer = batch.rows, batch.proposer
    depth = max(row.depth for row in rows)
    samplings = [row.sampling for row in rows]
    keys = [round_keys(row, depth) for row in rows]
    proposal = proposer.propose([r.depth for r in rows], samplings, [k[:depth] for k in keys])
    drafts = proposal.drafts
    if batch.draft_filter is not None:
        drafts = mx.stack(
            [batch.draft_filter(row, positions[r], drafts[r]) for r, row in enumerate(rows)]
        )
        proposal = RowsProposal(drafts, proposal.depths, proposal.dists)
    planned = None
    if batch.plan is not None:
        planned = [batch.plan(row, d) for row, d in zip(rows, proposal.depths, strict=True)]
    verified = verify_rows(batch.m, mx.concatenate([last, drafts], axis=1), batch.cache)
    packs, followers = row_verdicts(verified.logits, proposal, rows, [k[-1] for k in keys])
    state = proposer.after_verify(proposal, verified.hidden, followers)
    built = BuiltRound(rows, samplings, proposal, packs, verified, state, planned)
    launch = [state] if isinstance(state, mx.array) else []
    if not ahead or not verified.rolls_on_device or not proposer.rolls_on_device:
        if launch:
            mx.async_eval(launch)
        return built
    accepted = _accepted(packs, proposal.depths, rows, planned)
    kept = accepted + 1
    verified.rollback_on_device(batch.cache, kept)
    launch = proposer.settle_on_device(state, kept)
    built.accepted = accepted
    built.last = mx.take_along_axis(followers, accepted[:, None], axis=1)
    built.positions = positions + kept
    mx.async_eval(packs, built.last, built.positions, launch, _states(batch.cache))
    return built


def _accepted(
    packs: list[mx.array], depths: list[int], rows: list[Row], planned: list[int | None] | None
) -> mx.array:
    """Each row's accepted drafts [B] on the device: its packed verdict's, or the count its
    plan holds it to."""
    if planned is not None and all(n is not None for n in planned):
        return mx.array(planned, dtype=mx.int32)
    accepted = accepted_counts(packs, depths, [r.sampling.greedy for r in rows])
    if planned is None:
        return accepted
    held = mx.array([n is not None for n in planned])
    return mx.where(held, mx.array([n or 0 for n in planned], dtype=mx.int32), accepted)


def can_build_ahead(built: BuiltRound) -> bool:
    """Whether the round after `built` (rolled back on the device) may be built before
    `built` is read: some row goes on past it whatever it keeps."""
    longest = max(row.depth for row in built.rows) + 1
    return any(not row.done and len(row.tokens) + longest < row.max_tokens for row in built.rows)


@dataclass
class EndedRow:
    """A row that a round rolled back on the device ended: the round, the row's index in it,
    the verify inputs the device kept and those the row takes (up to its EOS or length)."""

    built: BuiltRound
    index: int
    kept: int
    taken: int


def ended_row_entry(
    batch: Batch, r: int, row: Row, ended: EndedRow, later: BuiltRound | None
) -> tuple[list[Any], Proposer]:
    """Row r's caches and drafter state as the prompt cache keeps a finished row's (what a
    round read first leaves: its prompt and output but the last), though the round that ended
    it was rolled back on the device to every confirmed token, and the round after it
    (`later`, built before that round was read) may have been built with it."""
    built, i, taken = ended.built, ended.index, ended.taken
    extra = ended.kept - taken  # entries past the row's end, in KV caches and the drafter's
    j = next((n for n, other in enumerate(later.rows) if other is row), None) if later else None
    if j is not None:  # the round after was built with it
        extra += int(later.accepted[j].item()) + 1
    snapshots = built.verified.snapshots
    recurrent = iter(zip(snapshots.conv_inputs, snapshots.states, strict=True) if snapshots else ())
    cache = []
    for layer in batch.cache:
        single = layer.extract(r)
        if is_recurrent_cache(layer):  # its state after the inputs the row takes
            conv_input, states = next(recurrent)
            n_keep = single[0].shape[1]
            single[0] = mx.contiguous(conv_input[i : i + 1, taken : taken + n_keep])
            single[1] = state_after(states, taken)[i : i + 1]
        elif extra:
            single.trim(extra)
        cache.append(single)
    return cache, batch.proposer.take_ended(r, built.state, i, taken, extra)


def _states(caches: list[Any]) -> list[Any]:
    return [c.state for c in caches]
