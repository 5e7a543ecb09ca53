"""A DFlash drafter for the rows of a batch (`DFlashRows`): the batched side of
`dflash.DFlashProposer`.

Each row is prefilled alone by its own `DFlashProposer`, as one stream is, and brings its
`DFlashStream` (its context K/V in its own drafter cache, the features not cached yet, its
last confirmed token) when it joins. The target's passes are batched and tapped as one
stream's are, so a round's verify pass and a plain batched step hand each row the features
of its own confirmed positions, which go to its stream as one stream's `settle` and
`observe` add them: nothing of the block is kept, so nothing is rolled back. A round drafts
each row's own block (its last token and as many mask tokens as its depth, up to the
drafter's block size), one drafter pass per row: the rows' contexts differ in length and
the block attends to all of it unmasked, so each row's drafts are exactly the ones it
drafts alone. The drafts are lazy, but each row's kept count is read on the host (its
features are a slice of the verify pass's): each round is read before the next is built.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.proposers.base import RowsBase, RowsProposal
from mtpkit.speculative.proposers.dflash import DFlashProposer


class DFlashRows(RowsBase):
    """The DFlash drafter drafting for every row of a batch (see the module's text)."""

    name = "dflash"

    def __init__(self, first: DFlashProposer) -> None:
        self.first = first  # the drafter and target every row shares (its stream: row 0's)
        self.rows: list[DFlashProposer] = [first]

    def join(self, proposer: DFlashProposer) -> None:
        self.rows.append(proposer)

    def keep(self, index: list[int]) -> None:
        self.rows = [self.rows[i] for i in index]

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        for r, token in enumerate(tokens.reshape(-1).tolist()):
            self.rows[r].observe(hidden[r : r + 1], [token])

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """Row r's block of `depths[r]` drafts (0 while it has no context, as one stream
        takes a plain step then), padded to the deepest row's [B, K] (a row verifies only
        its own)."""
        drafts: list[mx.array] = []
        dists: list[mx.array | None] = []
        for row, depth, s, row_keys in zip(self.rows, depths, sampling, keys, strict=True):
            if depth == 0 or not row.can_propose():
                drafts.append(mx.zeros((0,), dtype=mx.int32))
                dists.append(None)
                continue
            tokens, q = _block(row, depth, s, row_keys)
            drafts.append(tokens)
            dists.append(q)
        width = max(d.shape[0] for d in drafts)
        padded = [
            mx.concatenate([d, mx.zeros((width - d.shape[0],), dtype=mx.int32)]) for d in drafts
        ]
        return RowsProposal(mx.stack(padded), [d.shape[0] for d in drafts], dists)

    def after_verify(self, proposal: RowsProposal, hidden: mx.array, followers: mx.array) -> Any:
        return hidden  # every row's verify inputs' features [B, K+1, n*H]

    def settle(self, state: mx.array, kept: list[int], confirmed: list[list[int]]) -> None:
        """Row r's first `kept[r]` verify inputs are confirmed positions now."""
        for r, (row, n, tokens) in enumerate(zip(self.rows, kept, confirmed, strict=True)):
            row.stream.add(state[r : r + 1, :n])
            row.stream.last_token = tokens[-1]

    def take(self, r: int, tokens: list[int]) -> DFlashProposer:
        """Row r as one stream's proposer: its stream, over `tokens`, its own from now on."""
        proposer = copy.copy(self.first)
        proposer.stream = self.rows[r].stream.fork()
        return proposer


def _block(
    row: DFlashProposer, depth: int, sampling: SamplingSettings, keys: list[mx.array | None]
) -> tuple[mx.array, mx.array | None]:
    """Row `row`'s drafts [k] (k: `depth` up to the block size) and, when sampling, the
    distributions [k, V] they were drawn from, each by its own key (None: the global
    state, all at once as one stream draws them)."""
    logits = row.block_logits(depth)
    if sampling.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.int32), None
    q = sampling.probs(logits)
    if all(k is None for k in keys[: q.shape[0]]):
        return mx.random.categorical(mx.log(q)).astype(mx.int32), q
    picks = [mx.random.categorical(mx.log(q[k]), key=keys[k]) for k in range(q.shape[0])]
    return mx.stack(picks).astype(mx.int32), q

