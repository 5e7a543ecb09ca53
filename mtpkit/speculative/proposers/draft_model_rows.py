"""A separate draft model drafting for the rows of a batch (`DraftRows`): the batched side of
`draft_model.DraftModelProposer`.

Each row is prefilled alone by its own `DraftModelProposer`, as one stream is; joining, its
draft model's caches are brought to the row's confirmed tokens but the last and merged into
the batch's (mlx-lm's `merge`/`extend`, as the target's are), so every row's draft caches
hold its confirmed tokens but the confirmed tokens not fed yet (`unfed`: the same count in
every row, one per plain batched step since the last round, and the last). A round feeds
them in one forward over `[B, n]`, chains K drafts, and feeds the last draft too, so that a
row that keeps every draft has them all in its caches; each row then keeps its own prefix,
through `runtime.rollback.rows` (KV caches per row; recurrent layers, as in a hybrid draft
model, from their state after each step of the chain: `StepStates`).

A sliding-window draft model (`BatchRotatingKVCache`) cannot take its chain back that way:
once a window is full, each one-token step of the chain overwrites the oldest entry, which a
row that rejects the drafts still needs. So such a round keeps the caches' state before it
(handles, nothing copied: `rollback.state`), drafts, and settles by putting that state back
and feeding every row's kept drafts after its unfed tokens in one pass of several tokens
(which keeps `window - 1` older entries besides the new ones, as one stream's feed does),
right-padded to the deepest row's count, whose padding each shallower row then drops
(`rollback_rows`). One more draft-model pass a round, over the kept tokens only. A window
beside recurrent layers decodes alone (`batches`). The drafts are lazy, but the rollback
takes counts the host has read: each round is read before the next is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.mlxlm import window_in_temporal_order
from mtpkit.runtime.draft_vocab import FullVocab
from mtpkit.runtime.rollback.gdn import is_recurrent_cache
from mtpkit.runtime.rollback.rows import (
    BatchUnsupported,
    StepStates,
    batch_caches,
    leaves,
    require_batchable,
    rollback_rows,
)
from mtpkit.runtime.rollback.state import restore_state, saved_state
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.proposers.base import RowsBase, RowsProposal, draw_rows
from mtpkit.speculative.proposers.draft_model import FEED_CHUNK, DraftModelProposer

FLUSH_AFTER = 256  # plain steps' tokens left unfed before the draft model catches up
ROLLED_BACK = ("KVCache", "ArraysCache")  # the draft caches a row rolls back on its own
# A sliding-window draft model's: its windows are put back and fed again (module text).
REFED = ("KVCache", "RotatingKVCache")


def batches(proposer: DraftModelProposer) -> bool:
    """Whether `proposer`'s draft model decodes in a batch (its caches roll back per row, or
    its windows are put back and fed again)."""
    return any(_all_of(proposer.cache, kinds) for kinds in (ROLLED_BACK, REFED))


def _all_of(caches: list[Any], kinds: tuple[str, ...]) -> bool:
    try:
        for cache in caches:
            require_batchable(cache, kinds)
    except BatchUnsupported:
        return False
    return True


def fit_vocab(logits: mx.array, vocab: int) -> mx.array:
    """The draft model's logits [B, V_d] over the target's `vocab` ids (cut, or padded with
    -inf: a padded embedding's ids are never drafted)."""
    width = logits.shape[-1]
    if width > vocab:
        return logits[..., :vocab]
    if width < vocab:
        pad = mx.full((*logits.shape[:-1], vocab - width), -mx.inf, logits.dtype)
        return mx.concatenate([logits, pad], axis=-1)
    return logits


def _row_state(proposer: DraftModelProposer) -> tuple[list[Any], mx.array]:
    """A joining row's draft caches over its confirmed tokens but the last, and that last
    token [1, 1]."""
    history, cache, model = proposer.history, proposer.cache, proposer.draft.model
    rest = history[proposer.fed : -1]
    for i in range(0, len(rest), FEED_CHUNK):
        model(mx.array(rest[i : i + FEED_CHUNK])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache, mx.array([[history[-1]]], dtype=mx.int32)


@dataclass
class Chain:
    """A round's chain: `length` inputs each row may keep (its unfed tokens as one, then
    each draft) and every recurrent cache's state after each; with windows, every cache's
    state before the round (`saved`) instead."""

    length: int
    states: StepStates
    saved: list[dict[str, Any]] | None = None


class DraftRows(RowsBase):
    """The draft model drafting for every row of a batch (see the module's text)."""

    name = "draft-model"

    def __init__(self, first: DraftModelProposer) -> None:
        self.draft, self.vocab, self.step_cost = first.draft, first.vocab, first.step_cost
        self.full = FullVocab(None)  # draws over the target's ids, as they are
        cache, last = _row_state(first)
        self.cache = batch_caches([cache])
        from mlx_lm.models.cache import BatchRotatingKVCache

        self.windows = [c for c in leaves(self.cache) if isinstance(c, BatchRotatingKVCache)]
        self.unfed: list[mx.array] = [last]  # [B, 1] columns, the last confirmed last
        self._chain: Chain | None = None  # the round proposed, until the target verifies it

    def _forward(self, tokens: mx.array) -> mx.array:
        """The draft model over `tokens` [B, n] into the caches; its logits [B, n, V_d]. A
        window that one-token steps rotated goes back in temporal order first when n > 1
        (as the target's does before a verify pass: `verify_rows`)."""
        if tokens.shape[1] > 1:
            for window in self.windows:
                window_in_temporal_order(window)
        return self.draft.model(tokens, cache=self.cache)

    def _flush(self) -> None:
        """Feed every unfed column but the last (plain steps' tokens)."""
        if len(self.unfed) > 1:
            self._forward(mx.concatenate(self.unfed[:-1], axis=1))
            mx.eval([c.state for c in self.cache])
            self.unfed = self.unfed[-1:]

    def join(self, proposer: DraftModelProposer) -> None:
        self._flush()
        cache, last = _row_state(proposer)
        for layer, more in zip(self.cache, batch_caches([cache]), strict=True):
            layer.extend(more)
        self.unfed = [mx.concatenate([self.unfed[0], last])]

    def keep(self, index: list[int]) -> None:
        rows = mx.array(index, dtype=mx.int32)
        for cache in self.cache:
            cache.filter(rows)
        self.unfed = [column[rows] for column in self.unfed]

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        self.unfed.append(tokens.astype(mx.int32))
        if len(self.unfed) > FLUSH_AFTER:
            self._flush()

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """The deepest row's count of drafts for every row [B, K] (lazy)."""
        depth = max(depths)
        if depth == 0:  # every row's drafting is off: a plain step for all
            return RowsProposal.plain(depths)
        recurrent = [c for c in leaves(self.cache) if is_recurrent_cache(c)]
        steps = StepStates()
        saved = [saved_state(c) for c in leaves(self.cache)] if self.windows else None
        logits = self._forward(mx.concatenate(self.unfed, axis=1))[:, -1]
        steps.record(recurrent)
        drafts: list[mx.array] = []
        dists: list[list[mx.array]] = [[] for _ in sampling]
        for k in range(depth):
            if k > 0:
                logits = self._forward(drafts[-1][:, None])[:, -1]
                steps.record(recurrent)
            fitted = fit_vocab(logits, self.vocab)
            drafts.append(draw_rows(self.full, fitted, sampling, [r[k] for r in keys], dists))
        if saved is None:  # a row keeping every draft has them all
            self._forward(drafts[-1][:, None])
            steps.record(recurrent)
        self._chain = Chain(depth + 1, steps, saved)
        rows = [mx.stack(d) if d else None for d in dists]
        return RowsProposal(mx.stack(drafts, axis=1), depths, rows)

    def after_verify(self, proposal: RowsProposal, hidden: mx.array, followers: mx.array) -> Any:
        chain, self._chain = self._chain, None
        return chain if proposal.depth else None

    def settle(self, state: Chain | None, kept: list[int], confirmed: list[list[int]]) -> None:
        """Each row's caches back to its confirmed tokens but the last, which is unfed."""
        last = mx.array([[tokens[-1]] for tokens in confirmed], dtype=mx.int32)
        if state is None:  # no draft fed: the round was a plain step for every row
            self.unfed.append(last)
            return
        if state.saved is not None:
            self._refeed(state.saved, confirmed)
        else:
            rollback_rows(self.cache, state.length, kept, state.states)
        self.unfed = [last]

    def _refeed(self, saved: list[dict[str, Any]], confirmed: list[list[int]]) -> None:
        """The caches as before the round, then every row's unfed tokens and kept drafts
        (`confirmed[r]` but its last) fed in one pass, right-padded to the deepest row's,
        and each row's padding dropped (see the module's text)."""
        for cache, state in zip(leaves(self.cache), saved, strict=True):
            restore_state(cache, state)
        kept = [tokens[:-1] for tokens in confirmed]
        deepest = max(len(k) for k in kept)
        drafts = mx.array([k + [0] * (deepest - len(k)) for k in kept], dtype=mx.int32)
        unfed = mx.concatenate(self.unfed, axis=1)
        self._forward(mx.concatenate([unfed, drafts.reshape(len(kept), deepest)], axis=1))
        length = unfed.shape[1] + deepest
        rollback_rows(self.cache, length, [unfed.shape[1] + len(k) for k in kept], None)
        mx.eval([c.state for c in self.cache])

    def take(self, r: int, tokens: list[int]) -> DraftModelProposer:
        """Row r as one stream's proposer: its draft caches over `tokens` but those unfed."""
        proposer = DraftModelProposer(self.draft, self.vocab, self.step_cost)
        proposer.cache = [c.extract(r) for c in self.cache]
        proposer.history = list(tokens)
        proposer.fed = len(tokens) - len(self.unfed)
        return proposer
