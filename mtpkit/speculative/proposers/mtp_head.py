"""The checkpoint's own MTP head as the proposer: its KV cache, the confirmed pairs it has not
seen yet, and the drafts it chains."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.model import POST_NORM, MtpModel
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import Proposal, ProposerBase

HEAD_CHUNK = 2048  # pairs per head forward when it catches up with confirmed tokens
CATCH_UP_AFTER = 256  # pairs left pending (plain steps) before the head catches up


class HeadProposer(ProposerBase):
    """Drafts with the MTP head. Confirmed pairs (h_k, t_{k+1}) reach the head's cache in two
    ways: after a drafting round, by `after_verify` (all of the round's pairs in one step,
    before its acceptance is read) and `settle` (the unconfirmed ones trimmed), leaving
    `ready`, the head's output at the last confirmed pair; after plain steps, they wait in
    `pending` until the next draft or a catch-up runs the head over them."""

    name = "mtp"
    looks_ahead = True

    def __init__(self, m: MtpModel) -> None:
        self.m = m
        self.head = m.head
        self.cache = m.head.make_cache()
        self.pending_hidden: list[mx.array] = []
        self.pending_tokens: list[int] = []
        self.ready: mx.array | None = None
        self.prefilling = False

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

    def begin(self, prompt: list[int], cached: int) -> None:
        self.prefilling = True  # the prompt's pairs are caught up with once, at its end

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        self.pending_hidden.append(hidden)
        self.pending_tokens.extend(tokens)
        if not self.prefilling and len(self.pending_tokens) > CATCH_UP_AFTER:
            self.catch_up()  # drafting is off: keep the head's cache near the confirmed

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
            if sampling.greedy:
                token = vocab.token(mx.argmax(logits, axis=-1))
            else:
                q = vocab.probs(sampling, logits)
                token = vocab.token(mx.random.categorical(mx.log(q)))
                dists.append(vocab.spread(q))
            drafts.append(token.astype(mx.int32).reshape(1))
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
