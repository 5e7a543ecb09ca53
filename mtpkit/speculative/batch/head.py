"""The MTP head drafting for every row of a batch at once, its KV cache rolled back per row.

As for one stream (`mtpkit.speculative.proposers.mtp_head`), the head's step-0 layer sees every
confirmed pair (h_k, t_{k+1}); a round's pairs are run in one step over all K+1 verify
positions of every row, and each row then keeps its confirmed ones (`drop_per_row`). The
entries the chained drafts (steps 1..K-1) wrote are the same number in every row, a plain
trim. `ready` [B, 1, H] is the head's output at each row's last confirmed pair. Plain
batched steps confirm one pair per row each; they wait (`observe`) until the next draft, a
join or a leave runs the head over them (`catch_up`), in chunks of powers of two: on CUDA
each new count of pairs builds kernels on first use (a round after 32 plain steps of the
35B MoE took 265 ms against ~10 ms), and adaptive drafting's plain stretches leave counts
from 1 to `CATCH_UP_AFTER`, so a server meets at most nine counts, not 256.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.runtime.draft_vocab import FullVocab
from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.kernels.prompt import prompt_chunk
from mtpkit.runtime.model import POST_NORM, MtpModel
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.batch.rollback import drop_per_row, roll_per_row
from mtpkit.speculative.proposers.mtp_head import HEAD_CHUNK, HeadProposer

CATCH_UP_AFTER = 256  # plain steps' pairs left pending before the head catches up


def power_chunks(n: int) -> list[tuple[int, int]]:
    """[i, j) spans covering 0..n whose lengths are the powers of two that sum to n, largest
    first (37: 0-32, 32-36, 36-37)."""
    spans, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n & (1 << bit):
            spans.append((start, start + (1 << bit)))
            start += 1 << bit
    return spans


def row_head(m: MtpModel, proposer: HeadProposer) -> tuple[list[Any], mx.array]:
    """A joining row's head: `proposer`'s cache run over its pending pairs (every one, in
    chunks), and its output at the last pair [1, 1, H] (the pair of the row's first token)."""
    hidden, tokens = proposer.pending_hidden, proposer.pending_tokens
    hidden = mx.concatenate(hidden, axis=1)
    cache, x = proposer.cache, None
    for i in range(0, len(tokens), HEAD_CHUNK):
        j = min(i + HEAD_CHUNK, len(tokens))
        with prompt_chunk():  # CUDA: no attention build for this length
            x = m.head(hidden[:, i:j], m.embed(mx.array(tokens[i:j])[None]), cache)
        mx.eval(x, [c.state for c in cache])
    return cache, x[:, -1:]


def row_proposer(head: BatchHead, r: int, tokens: list[int]) -> HeadProposer:
    """Row r's head state as one stream's proposer holds it (its cache, and its pending
    pairs or its output at the last pair), for a prompt cache's entry; `tokens`: the row's
    confirmed tokens, the last ones of which are the pending pairs' followers."""
    cache = [c.extract(r) for c in head.cache]
    if head.pending:
        hidden = [h[r : r + 1] for h, _ in head.pending]
        pending = (hidden, tokens[len(tokens) - len(head.pending) :])
        return HeadProposer.holding(head.m, cache, pending=pending)
    return HeadProposer.holding(head.m, cache, ready=head.ready[r : r + 1])


class BatchHead:
    """The head's batched cache and each row's output at its last confirmed pair."""

    def __init__(self, m: MtpModel, cache: list[Any], ready: mx.array) -> None:
        self.m, self.head = m, m.head
        self.cache = cache
        self.ready = ready
        self.pending: list[tuple[mx.array, mx.array]] = []  # (hidden [B, 1, H], tokens [B, 1])

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        """A plain step's pairs: each row's hidden state [B, 1, H] and the token after it."""
        self.pending.append((hidden, tokens))
        if len(self.pending) >= CATCH_UP_AFTER:  # a long plain stretch: keep the head near
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
        self, depth: int, sampling: list[SamplingSettings], keys: list[list[mx.array | None]]
    ) -> tuple[mx.array, list[mx.array | None]]:
        """`depth` drafts per row [B, K] (lazy) and, for each sampled row, the distributions
        [K, V] its drafts were drawn from (None for a greedy row). `keys[r][k]`: the PRNG
        key of row r's k-th draw (None: MLX's global state)."""
        head, m = self.head, self.m
        self.catch_up()
        if depth == 0:  # every row's drafting is off: a plain step for all
            return mx.zeros((self.ready.shape[0], 0), dtype=mx.int32), [None] * len(sampling)
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
            drafts.append(
                self._draw(m.drafting, logits, sampling, [row[k] for row in keys], dists)
            )
        rows = [mx.stack(d) if d else None for d in dists]
        return mx.stack(drafts, axis=1), rows

    @staticmethod
    def _draw(
        vocab: FullVocab,
        logits: mx.array,
        sampling: list[SamplingSettings],
        keys: list[mx.array | None],
        dists: list[list[mx.array]],
    ) -> mx.array:
        """Each row's draft [B] int32: the argmax for a greedy row, else a draw from its
        settings' distribution (kept in `dists`, over the whole vocabulary, for rejection
        sampling). `vocab` maps a subset's indices back to token ids."""
        tokens = vocab.token(mx.argmax(logits, axis=-1)).astype(mx.int32)
        if all(s.greedy for s in sampling):
            return tokens
        picks = []
        for r, s in enumerate(sampling):
            if s.greedy:
                picks.append(tokens[r])
                continue
            q = vocab.probs(s, logits[r])
            dists[r].append(vocab.spread(q))
            pick = vocab.token(mx.random.categorical(mx.log(q), key=keys[r]))
            picks.append(pick.astype(mx.int32))
        return mx.stack(picks)

    def after_verify(self, depth: int, hidden: mx.array, followers: mx.array) -> mx.array:
        """The head's step over every verified pair of every row (hidden [B, K+1, H],
        `followers` [B, K+1]: the confirmed token after each input); the drafts' own entries
        leave the chained layers first. Returns its output [B, K+1, H]."""
        per_layer = [0] * len(self.cache)
        for step in range(1, depth):
            per_layer[self.head.layer_for_step(step)] += 1
        for cache, n in zip(self.cache, per_layer, strict=True):
            if n:
                cache.trim(n)
        with few_query_attention():
            return self.head(hidden, self.m.embed(followers), self.cache, step=0)

    def settle(self, out: mx.array, kept: list[int]) -> None:
        """Row r keeps its first `kept[r]` pairs of the round; it drafts next from the last."""
        drop_per_row(self.cache[self.head.layer_for_step(0)], [out.shape[1] - k for k in kept])
        index = mx.array([k - 1 for k in kept], dtype=mx.int32)
        self.ready = mx.take_along_axis(out, index[:, None, None], axis=1)

    def settle_on_device(self, out: mx.array, kept: mx.array) -> None:
        """`settle` with the kept counts on the device ([B] int32, not read yet)."""
        roll_per_row(self.cache[self.head.layer_for_step(0)], out.shape[1] - kept)
        self.ready = mx.take_along_axis(out, (kept - 1)[:, None, None], axis=1)

    def filter(self, keep: list[int]) -> None:
        index = mx.array(keep, dtype=mx.int32)
        self.pending = [(h[index], t[index]) for h, t in self.pending]
        for cache in self.cache:
            cache.filter(keep)
        self.ready = self.ready[index]

    def extend(self, other: BatchHead) -> None:
        self.catch_up()  # the joining row has no pending pairs
        for cache, more in zip(self.cache, other.cache, strict=True):
            cache.extend(more)
        self.ready = mx.concatenate([self.ready, other.ready])
