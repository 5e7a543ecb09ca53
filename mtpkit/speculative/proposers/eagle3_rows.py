"""An EAGLE-3 drafter drafting for the rows of a batch (`Eagle3Rows`): the batched side of
`eagle3.Eagle3Proposer`.

Each row is prefilled alone by its own `Eagle3Proposer`, as one stream is; joining, its
drafter's KV cache is run over its confirmed pairs but the last and merged into the batch's
(mlx-lm's `merge`/`extend`, left-padded as the target's are; the drafter's attention masks
each row's padding), so every row's cache holds its confirmed pairs (g_p, t_{p+1}) but those
pending: the same count in every row, the last confirmed pair and one more per plain batched
step since. A round runs the pending pairs in one forward over `[B, n]`, drafts the first
token from the last and chains the rest, one step each, as one stream does. Settling, the
chained steps' entries leave every row (a plain trim: the same count), the round's verified
pairs (the verify pass's taps and the token after each) go into the cache in one forward,
and each row keeps its own confirmed ones but the last (`runtime.rollback.rows.drop_per_row`),
whose pair is pending again. Causal attention keeps a row's kept pairs blind to the rejected
ones after them. The rollback takes counts the host has read: each round is read before the
next is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.rollback.rows import batch_caches, drop_per_row
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.proposers.base import RowsBase, RowsProposal, draw_rows
from mtpkit.speculative.proposers.eagle3 import CATCH_UP_CHUNK, Eagle3Proposer


def _row_state(proposer: Eagle3Proposer) -> tuple[list[Any], mx.array, mx.array]:
    """A joining row's drafter cache over its confirmed pairs but the last, and that last
    pair: its target states [1, 1, 3H_t] and the token after them [1, 1]."""
    features = mx.concatenate(proposer.features, axis=1)
    tokens, model = proposer.tokens, proposer.drafter.model
    n = len(tokens) - 1
    for i in range(0, n, CATCH_UP_CHUNK):
        j = min(i + CATCH_UP_CHUNK, n)
        embeds = proposer._embed(mx.array(tokens[i:j], dtype=mx.int32)[None])
        model(embeds, model.fuse(features[:, i:j]), proposer.cache)
        mx.eval([c.state for c in proposer.cache])
    return proposer.cache, features[:, n:], mx.array([tokens[n:]], dtype=mx.int32)


@dataclass
class Chain:
    """A round's work for `settle`: whether its drafts were chained (`chained` steps into
    the cache; None: no row drafted, its pending pairs wait) and the verify pass's target
    states [B, K+1, 3H_t] and followers [B, K+1]."""

    chained: int | None
    hidden: mx.array
    followers: mx.array


class Eagle3Rows(RowsBase):
    """The EAGLE-3 drafter drafting for every row of a batch (see the module's text)."""

    name = "eagle3"

    def __init__(self, first: Eagle3Proposer) -> None:
        self.m, self.drafter, self.step_cost = first.m, first.drafter, first.step_cost
        self.model, self.vocab = first.drafter.model, first.vocab
        cache, features, tokens = _row_state(first)
        self.cache = batch_caches([cache])
        self.pending: list[tuple[mx.array, mx.array]] = [(features, tokens)]  # [B, n, ...]
        self._chained: int | None = None  # the round proposed, until the target verifies it

    def _embed(self, tokens: mx.array) -> mx.array:
        own = getattr(self.model, "embed_tokens", None)
        return own(tokens) if own is not None else self.m.embed(tokens)

    def _run(self, features: mx.array, tokens: mx.array) -> mx.array:
        """The drafter over pairs of every row (into the cache); its outputs [B, n, H]."""
        with few_query_attention():  # CUDA: no cuDNN build at each new key length
            return self.model(self._embed(tokens), self.model.fuse(features), self.cache)

    def _flush(self) -> None:
        """Run every pending pair but the last (plain steps') into the cache."""
        if len(self.pending) > 1:
            features = mx.concatenate([f for f, _ in self.pending[:-1]], axis=1)
            tokens = mx.concatenate([t for _, t in self.pending[:-1]], axis=1)
            self._run(features, tokens)
            mx.eval([c.state for c in self.cache])
            self.pending = self.pending[-1:]

    def join(self, proposer: Eagle3Proposer) -> None:
        self._flush()
        cache, features, tokens = _row_state(proposer)
        for layer, more in zip(self.cache, batch_caches([cache]), strict=True):
            layer.extend(more)
        ((have, had),) = self.pending
        self.pending = [(mx.concatenate([have, features]), mx.concatenate([had, tokens]))]

    def keep(self, index: list[int]) -> None:
        rows = mx.array(index, dtype=mx.int32)
        for cache in self.cache:
            cache.filter(rows)
        self.pending = [(f[rows], t[rows]) for f, t in self.pending]

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        self.pending.append((hidden, tokens.astype(mx.int32)))
        if len(self.pending) > CATCH_UP_CHUNK:
            self._flush()

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """The deepest row's count of drafts for every row [B, K] (lazy)."""
        depth = max(depths)
        if depth == 0:  # every row's drafting is off: a plain step for all
            self._chained = None
            return RowsProposal.plain(depths)
        features = mx.concatenate([f for f, _ in self.pending], axis=1)
        tokens = mx.concatenate([t for _, t in self.pending], axis=1)
        self.pending = []
        x = self._run(features, tokens)[:, -1:]
        drafts: list[mx.array] = []
        dists: list[list[mx.array]] = [[] for _ in sampling]
        for k in range(depth):
            if k > 0:
                x = self.model(self._embed(drafts[-1][:, None]), x, self.cache)
            logits = self.vocab.logits(x)[:, -1]  # [B, N] over the draft vocabulary
            drafts.append(draw_rows(self.vocab, logits, sampling, [r[k] for r in keys], dists))
        self._chained = depth - 1
        rows = [mx.stack(d) if d else None for d in dists]
        return RowsProposal(mx.stack(drafts, axis=1), depths, rows)

    def after_verify(self, proposal: RowsProposal, hidden: mx.array, followers: mx.array) -> Chain:
        chained, self._chained = self._chained, None
        return Chain(chained, hidden, followers)

    def settle(self, state: Chain, kept: list[int], confirmed: list[list[int]]) -> None:
        """Each row's cache back to its confirmed pairs but the last, which is pending."""
        last = mx.array([[tokens[-1]] for tokens in confirmed], dtype=mx.int32)
        index = mx.array(kept, dtype=mx.int32)[:, None, None] - 1
        features = mx.take_along_axis(state.hidden, index, axis=1)  # [B, 1, 3H_t]
        if state.chained is None:  # no row drafted: the round's pair joins the pending ones
            self.pending.append((features, last))
            return
        if state.chained:
            self.cache[0].trim(state.chained)  # every row chained as many
        length = state.hidden.shape[1] - 1  # the pairs a row may keep but its last
        if length:
            self._run(state.hidden[:, :length], state.followers[:, :length].astype(mx.int32))
            drop_per_row(self.cache[0], [length - (k - 1) for k in kept])
        self.pending = [(features, last)]

    def take(self, r: int, tokens: list[int]) -> Eagle3Proposer:
        """Row r as one stream's proposer: its cache over `tokens`' pairs but those pending,
        and its pending pairs (whose followers are the last of `tokens`)."""
        from mlx_lm.models.cache import KVCache

        proposer = Eagle3Proposer(self.m, self.drafter, self.step_cost)
        proposer.cache = [c.extract(r) if c.keys is not None else KVCache() for c in self.cache]
        n = sum(f.shape[1] for f, _ in self.pending)
        proposer.features = [mx.concatenate([f[r : r + 1] for f, _ in self.pending], axis=1)]
        proposer.tokens = list(tokens[len(tokens) - n :])
        return proposer
