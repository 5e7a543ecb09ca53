"""The checkpoint's own MTP head as the proposer: its KV cache, the confirmed pairs it has not
seen yet, and the drafts it chains; for one stream (`HeadProposer`) and for the rows of a batch
(`HeadRows`).

In a batch, as for one stream, the head's step-0 layer sees every confirmed pair
(h_k, t_{k+1}); a round's pairs are run in one step over all K+1 verify positions of every
row, and each row then keeps its confirmed ones (`runtime.rollback.rows.drop_per_row`). The
entries the chained drafts (steps 1..K-1) wrote are the same number in every row, a plain
trim. `ready` [B, 1, H] is the head's output at each row's last confirmed pair. Plain
batched steps confirm one pair per row each; they wait (`observe`) until the next draft, a
join or a leave runs the head over them (`catch_up`), in chunks of powers of two: on CUDA
each new count of pairs builds kernels on first use (a round after 32 plain steps of the
35B MoE took 265 ms against ~10 ms), and adaptive drafting's plain stretches leave counts
from 1 to `ROWS_CATCH_UP_AFTER`, so a server meets at most nine counts, not 256.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.kernels.prompt import prompt_chunk
from mtpkit.runtime.model import POST_NORM, MtpModel
from mtpkit.runtime.rollback.rows import batch_caches, drop_per_row, roll_per_row
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import (
    Proposal,
    ProposerBase,
    RowsBase,
    RowsProposal,
    draw_rows,
)

HEAD_CHUNK = 2048  # pairs per head forward when it catches up with confirmed tokens
CATCH_UP_AFTER = 256  # pairs left pending (plain steps) before the head catches up
ROWS_CATCH_UP_AFTER = 256  # a batch's plain steps' pairs left pending before it catches up
# Parked, or paused without a draft ever kept (`rest`), the head runs over none of them:
# past CATCH_UP_AFTER it keeps only the last RESTING_PAIRS, which the retry's first draft runs
# over. Its cache then misses the pairs in between (its own positions run on from its cache's
# length; what it drafts stays verified); it reads the context from the target's hidden
# state, so a retry still drafts.
RESTING_PAIRS = 32


class HeadProposer(ProposerBase):
    """Drafts with the MTP head. Confirmed pairs (h_k, t_{k+1}) reach the head's cache in two
    ways: after a drafting round, by `after_verify` (all of the round's pairs in one step,
    before its acceptance is read) and `settle` (the unconfirmed ones trimmed), leaving
    `ready`, the head's output at the last confirmed pair; after plain steps, they wait in
    `pending` until the next draft or a catch-up runs the head over them (while resting,
    only the last RESTING_PAIRS of them are kept: `rest`)."""

    name = "mtp"
    looks_ahead = True
    batches = True

    def __init__(self, m: MtpModel) -> None:
        self.m = m
        self.head = m.head
        self.cache = m.head.make_cache()
        self.pending_hidden: list[mx.array] = []
        self.pending_tokens: list[int] = []
        self.ready: mx.array | None = None
        self.prefilling = False
        self.resting = False

    @classmethod
    def holding(
        cls,
        m: MtpModel,
        cache: list[Any],
        *,
        ready: mx.array | None = None,
        pending: tuple[list[mx.array], list[int]] | None = None,
    ) -> HeadProposer:
        """A proposer in a given state (a batch row's, taken out for the prompt cache): its
        head cache, and its output at the last confirmed pair (`ready`) or the pairs it has
        not run yet (`pending`: their hidden states [1, T, H] and tokens)."""
        proposer = cls(m)
        proposer.cache = cache
        proposer.ready = ready
        if pending is not None:
            proposer.pending_hidden, proposer.pending_tokens = list(pending[0]), list(pending[1])
        return proposer

    def caches(self) -> list[Any]:
        return list(self.cache)

    def batched(self) -> HeadRows:
        return HeadRows.of(self)

    def begin(self, prompt: list[int], cached: int) -> None:
        self.prefilling = True  # the prompt's pairs are caught up with once, at its end

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        self.pending_hidden.append(hidden)
        self.pending_tokens.extend(tokens)
        if self.prefilling or len(self.pending_tokens) <= CATCH_UP_AFTER:
            return
        if self.resting:  # the head runs again only at a retry: keep what it starts from
            hidden, tokens = self._pending()
            self.pending_hidden = [hidden[:, -RESTING_PAIRS:]]
            self.pending_tokens = tokens[-RESTING_PAIRS:]
        else:
            self.catch_up()  # drafting is off: keep the head's cache near the confirmed

    def rest(self, parked: bool) -> None:
        self.resting = parked

    def end_prefill(self) -> None:
        self.prefilling = False
        # The prefill left the prompt's hidden states lazy: computed here a chunk at a time,
        # as the prefill computes its caches.
        for hidden in self.pending_hidden:
            mx.eval(hidden)
        if len(self.pending_tokens) > 1:
            self.catch_up()  # the head's KV cache over the prompt

    def defers_catch_up(self) -> bool:
        """A prompt of more than `CATCH_UP_AFTER` pairs: its catch-up (the target's last
        layer over the prompt, which only the head reads, and the head's KV) waits for the
        first token. A shorter one's costs less than the tokens a first round drafts."""
        return len(self.pending_tokens) > CATCH_UP_AFTER

    def _pending(self) -> tuple[mx.array, list[int]]:
        return mx.concatenate(self.pending_hidden, axis=1), self.pending_tokens

    def catch_up(self, keep_last: bool = True) -> None:
        """Run the head over the pending pairs (keeping the last one to draft from). Only
        its cache is computed: its outputs at these pairs are read by nothing, and its KV
        needs only the projections of each pair, not the attention over the prompt or the
        MLP (at 3,500 prompt tokens of the bundled example, 0.06 s against 2.0 s)."""
        hidden, tokens = self._pending()
        n = len(tokens) - (1 if keep_last else 0)
        for i in range(0, n, HEAD_CHUNK):
            j = min(i + HEAD_CHUNK, n)
            with prompt_chunk():  # CUDA: no attention build for this length
                self.head(hidden[:, i:j], self.m.embed(mx.array(tokens[i:j])[None]), self.cache)
            mx.eval([c.state for c in self.cache])
        self.pending_hidden = [hidden[:, n:]]
        self.pending_tokens = tokens[n:]

    def can_propose(self) -> bool:
        return bool(self.pending_tokens) or self.ready is not None

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal:
        """`depth` draft tokens (lazy, [K] int32) and, when sampling, their distributions
        [K, V]. Consumes the pending pairs (or `ready`)."""
        head, m = self.head, self.m
        if self.pending_tokens:
            hidden, tokens = self._pending()
            self.pending_hidden, self.pending_tokens = [], []
            with few_query_attention():  # a few pairs at a new length (CUDA: no build)
                x = head(hidden, m.embed(mx.array(tokens)[None]), self.cache, step=0)[:, -1:]
        else:
            x = self.ready
        self.ready = None
        drafts: list[mx.array] = []
        dists = []
        normed = None
        vocab = m.drafting  # every token, or the subset of `convert --draft-vocab`
        for k in range(depth):
            if k > 0:
                prev = normed if m.hidden == POST_NORM else x
                x = head(prev, m.embed(drafts[-1].reshape(1, 1)), self.cache, step=k)
            normed = head.final_norm(head.layer_for_step(k))(x)
            logits = vocab.logits(normed)[0, -1]
            token, dist = vocab.draw(sampling, logits)
            if dist is not None:
                dists.append(dist)
            drafts.append(token.reshape(1))
        return Proposal(mx.concatenate(drafts), mx.stack(dists) if dists else None)

    def drop_drafts(self, depth: int) -> None:
        """Drop the head-cache entries built on drafts (steps 1..depth-1)."""
        per_layer = [0] * len(self.cache)
        for step in range(1, depth):
            per_layer[self.head.layer_for_step(step)] += 1
        for cache, n in zip(self.cache, per_layer, strict=True):
            if n:
                cache.trim(n)

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> mx.array:
        """Start the head's step over every pair of the verify pass (hidden [1, K+1, H], the
        token after each input) before the host knows how many are confirmed (one call,
        queued with `mx.async_eval` unless `launch` is False); `settle` keeps the confirmed
        ones. Returns its output, the round's state."""
        self.drop_drafts(proposal.depth)
        with few_query_attention():  # K+1 pairs at a new length (CUDA: no build)
            out = self.head(hidden, self.m.embed(followers[None]), self.cache, step=0)
        if launch:
            mx.async_eval(out)
        return out

    def assume_kept(self, state: mx.array) -> None:
        self.ready = state[:, -1:]

    def drop_step0(self, n: int) -> None:
        """Drop the last `n` entries of step 0's layer (pairs queued but not confirmed)."""
        if n:
            self.cache[self.head.layer_for_step(0)].trim(n)

    def discard(self, state: mx.array, launched: bool) -> None:
        if launched:  # unlaunched: the decoder puts the whole cache back
            self.drop_step0(state.shape[1])

    def settle(self, state: mx.array, verdict: Verdict, premise_held: bool) -> None:
        """Keep the queued step's confirmed pairs; the next draft starts from the last."""
        if premise_held:
            return
        kept = verdict.accepted + 1
        self.drop_step0(state.shape[1] - kept)
        self.ready = state[:, kept - 1 : kept]


def power_chunks(n: int) -> list[tuple[int, int]]:
    """[i, j) spans covering 0..n whose lengths are the powers of two that sum to n, largest
    first (37: 0-32, 32-36, 36-37)."""
    spans, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n & (1 << bit):
            spans.append((start, start + (1 << bit)))
            start += 1 << bit
    return spans


def _row_state(proposer: HeadProposer) -> tuple[list[Any], mx.array]:
    """A joining row's head: `proposer`'s cache run over its pending pairs (every one, in
    chunks), and its output at the last pair [1, 1, H] (the pair of the row's first token)."""
    m = proposer.m
    hidden, tokens = mx.concatenate(proposer.pending_hidden, axis=1), proposer.pending_tokens
    cache, x = proposer.cache, None
    for i in range(0, len(tokens), HEAD_CHUNK):
        j = min(i + HEAD_CHUNK, len(tokens))
        with prompt_chunk():  # CUDA: no attention build for this length
            x = m.head(hidden[:, i:j], m.embed(mx.array(tokens[i:j])[None]), cache)
        mx.eval(x, [c.state for c in cache])
    return cache, x[:, -1:]


class HeadRows(RowsBase):
    """The head drafting for every row of a batch (see the module's text): its batched
    cache, each row's output at its last confirmed pair, and plain steps' pairs pending."""

    name = "mtp"
    rolls_on_device = True

    def __init__(self, m: MtpModel, cache: list[Any], ready: mx.array) -> None:
        self.m, self.head = m, m.head
        self.cache = cache
        self.ready = ready
        self.pending: list[tuple[mx.array, mx.array]] = []  # (hidden [B, 1, H], tokens [B, 1])

    @classmethod
    def of(cls, proposer: HeadProposer) -> HeadRows:
        cache, ready = _row_state(proposer)
        return cls(proposer.m, batch_caches([cache]), ready)

    def join(self, proposer: HeadProposer) -> None:
        self.catch_up()  # the joining row has no pending pairs
        other = HeadRows.of(proposer)
        for cache, more in zip(self.cache, other.cache, strict=True):
            cache.extend(more)
        self.ready = mx.concatenate([self.ready, other.ready])

    def keep(self, index: list[int]) -> None:
        rows = mx.array(index, dtype=mx.int32)
        self.pending = [(h[rows], t[rows]) for h, t in self.pending]
        for cache in self.cache:
            cache.filter(rows)
        self.ready = self.ready[rows]

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        self.pending.append((hidden, tokens))
        if len(self.pending) >= ROWS_CATCH_UP_AFTER:  # a long plain stretch: keep the head near
            self.catch_up()
            mx.eval(self.ready, [c.state for c in self.cache])

    def catch_up(self) -> None:
        """Run the head over the plain steps' pairs (the same count in every row), in chunks
        of powers of two, largest first (`power_chunks`)."""
        if not self.pending:
            return
        hidden = mx.concatenate([h for h, _ in self.pending], axis=1)
        tokens = mx.concatenate([t for _, t in self.pending], axis=1)
        self.pending = []
        embedded = self.m.embed(tokens)
        with few_query_attention():  # a few pairs at a new length (CUDA: no build)
            for i, j in power_chunks(hidden.shape[1]):
                out = self.head(hidden[:, i:j], embedded[:, i:j], self.cache, step=0)
        self.ready = out[:, -1:]

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """The deepest row's count of drafts for every row [B, K] (lazy); each row verifies
        its own first `depths[r]`."""
        head, m = self.head, self.m
        self.catch_up()
        depth = max(depths)
        if depth == 0:  # every row's drafting is off: a plain step for all
            return RowsProposal.plain(depths)
        x = self.ready
        drafts: list[mx.array] = []
        dists: list[list[mx.array]] = [[] for _ in sampling]
        normed = None
        for k in range(depth):
            if k > 0:
                prev = normed if m.hidden == POST_NORM else x
                x = head(prev, m.embed(drafts[-1][:, None]), self.cache, step=k)
            normed = head.final_norm(head.layer_for_step(k))(x)
            logits = m.drafting.logits(normed)[:, -1]  # [B, V], or [B, N] over a subset
            drafts.append(draw_rows(m.drafting, logits, sampling, [r[k] for r in keys], dists))
        rows = [mx.stack(d) if d else None for d in dists]
        return RowsProposal(mx.stack(drafts, axis=1), depths, rows)

    def after_verify(
        self, proposal: RowsProposal, hidden: mx.array, followers: mx.array
    ) -> mx.array:
        """The head's step over every verified pair of every row (one call, lazy); the
        drafts' own entries leave the chained layers first. Returns its output [B, K+1, H]."""
        per_layer = [0] * len(self.cache)
        for step in range(1, proposal.depth):
            per_layer[self.head.layer_for_step(step)] += 1
        for cache, n in zip(self.cache, per_layer, strict=True):
            if n:
                cache.trim(n)
        with few_query_attention():
            return self.head(hidden, self.m.embed(followers), self.cache, step=0)

    def settle(self, state: mx.array, kept: list[int], confirmed: list[list[int]]) -> None:
        """Row r keeps its first `kept[r]` pairs of the round; it drafts next from the last."""
        drop_per_row(self.cache[self.head.layer_for_step(0)], [state.shape[1] - k for k in kept])
        index = mx.array([k - 1 for k in kept], dtype=mx.int32)
        self.ready = mx.take_along_axis(state, index[:, None, None], axis=1)

    def settle_on_device(self, state: mx.array, kept: mx.array) -> list[mx.array]:
        roll_per_row(self.cache[self.head.layer_for_step(0)], state.shape[1] - kept)
        self.ready = mx.take_along_axis(state, (kept - 1)[:, None, None], axis=1)
        return [self.ready]

    def take(self, r: int, tokens: list[int]) -> HeadProposer:
        """Row r's head state as one stream's proposer holds it: its cache, and its pending
        pairs (whose followers are the last of `tokens`) or its output at the last pair."""
        cache = [c.extract(r) for c in self.cache]
        if self.pending:
            hidden = [h[r : r + 1] for h, _ in self.pending]
            pending = (hidden, tokens[len(tokens) - len(self.pending) :])
            return HeadProposer.holding(self.m, cache, pending=pending)
        return HeadProposer.holding(self.m, cache, ready=self.ready[r : r + 1])

    def take_ended(
        self, r: int, state: mx.array, index: int, taken: int, extra: int
    ) -> HeadProposer:
        """Its step-0 entries past what it takes dropped; its output at its last pair taken
        from the round that ended it."""
        cache = [c.extract(r) for c in self.cache]
        if extra:
            cache[self.head.layer_for_step(0)].trim(extra)
        return HeadProposer.holding(
            self.m, cache, ready=state[index : index + 1, taken - 1 : taken]
        )
