"""A DFlash block drafter as the proposer (`--draft-model DFLASH_DIR`).

One drafter pass proposes a whole block: its input is the last confirmed token followed by
K mask tokens, embedded by the target, and the target's context features (the outputs of
the layers the drafter reads, `mtpkit.runtime.model.MtpModel.tap_layers`) of every
confirmed position before it; the K outputs after the first are the drafts (z-lab's
`dflash_generate`). The features of the positions a round confirms come from that round's
verify pass, so the target runs nothing extra; the drafter keeps their K/V in its own cache
and never keeps the block's, so nothing of it is rolled back.

A sequence's state is one `DFlashStream` (cache, features not yet cached, last token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mtpkit.runtime.dflash import DFlashDrafter
from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.model import MtpModel
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import DrafterKind, Proposal, ProposerBase

if TYPE_CHECKING:
    from mtpkit.speculative.proposers.dflash_rows import DFlashRows

CONTEXT_CHUNK = 64  # pending positions past which their context K/V are computed at once


@dataclass
class DFlashStream:
    """One sequence's drafting state: positions `0 .. covered` have context features, the
    first `cache[0].offset` of them in the drafter's cache and the rest in `pending`."""

    cache: list[Any]
    pending: mx.array | None = None  # [1, S, n*H]
    last_token: int = 0  # the last confirmed token: the block's first input
    blind: bool = False  # positions before the target's cache have no features: no drafts

    @property
    def cached(self) -> int:
        return int(self.cache[0].offset)

    @property
    def covered(self) -> int:
        return self.cached + (0 if self.pending is None else int(self.pending.shape[1]))

    def add(self, features: mx.array) -> None:
        """Features of the next confirmed positions."""
        self.pending = (
            features if self.pending is None else mx.concatenate([self.pending, features], axis=1)
        )

    def cut(self, positions: int) -> None:
        """Keep the first `positions` positions' features."""
        if positions < self.cached:
            for c in self.cache:
                c.trim(self.cached - positions)
            self.pending = None
        elif self.pending is not None:
            keep = positions - self.cached
            self.pending = self.pending[:, :keep] if keep else None

    def fork(self) -> DFlashStream:
        from mtpkit.runtime.rollback.state import fork_cache

        return DFlashStream([fork_cache(c) for c in self.cache], self.pending,
                            self.last_token, self.blind)  # fmt: skip


class DFlashProposer(ProposerBase):
    """Drafts a block with `drafter` for the target `m` (see the module's text).
    `step_cost`: a drafter pass's share of a target step, for adaptive drafting."""

    name = "dflash"
    batches = True  # `batched`: `dflash_rows.DFlashRows`

    def __init__(self, m: MtpModel, drafter: DFlashDrafter, step_cost: float | None = None) -> None:
        self.m, self.drafter = m, drafter
        # Every pass of the target now yields the features of the layers the drafter reads.
        m.tap_layers(drafter.layout.target_layer_ids)
        self.mask = int(drafter.layout.mask_token_id)
        self.stream = DFlashStream(drafter.model.make_cache())
        self.step_cost = step_cost

    def caches(self) -> list[Any]:
        return list(self.stream.cache)

    def begin(self, prompt: list[int], cached: int) -> None:
        s = self.stream
        s.last_token = prompt[-1]
        if s.covered < cached:  # a restored state older than the target's cache
            s.blind = True
        else:
            s.cut(cached)
            s.blind = False

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        s = self.stream
        s.add(hidden)
        s.last_token = tokens[-1]
        if s.pending is not None and s.pending.shape[1] >= CONTEXT_CHUNK:
            # A prompt's chunk: its context K/V now, so no prompt-long features are held.
            self.drafter.model.add_context(s.pending, s.cache)
            s.pending = None
            mx.eval([c.state for c in s.cache])

    def can_propose(self) -> bool:
        # Until the target has computed one position there is no context (a one-token prompt).
        return not self.stream.blind and self.stream.covered > 0

    def block_logits(self, depth: int) -> mx.array:
        """The drafter's pass over the block of `depth` (up to the block size) mask tokens:
        the logits [K, V] of the block's positions after the first."""
        s = self.stream
        depth = max(1, min(depth, self.drafter.layout.max_drafts))
        block = mx.array([[s.last_token] + [self.mask] * depth], dtype=mx.int32)
        with few_query_attention():  # CUDA: no cuDNN build at each new key length
            h = self.drafter.model(self.m.embed(block), s.pending, s.cache)
        s.pending = None  # now in the drafter's cache
        return self.m.lm_head(h[:, 1:])[0]

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal:
        logits = self.block_logits(depth)
        if sampling.greedy:
            return Proposal(mx.argmax(logits, axis=-1).astype(mx.int32))
        # The block's drafts are drawn independently, each from its own position's output.
        q = sampling.probs(logits)
        return Proposal(mx.random.categorical(mx.log(q)).astype(mx.int32), q)

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> mx.array:
        return hidden  # the verify inputs' features [1, K+1, n*H]

    def settle(self, state: mx.array, verdict: Verdict, premise_held: bool) -> None:
        """The last confirmed token and the kept drafts are confirmed positions now."""
        self.stream.add(state[:, : verdict.accepted + 1])
        self.stream.last_token = verdict.token

    def cost_prior(self, depth: int) -> float | None:
        """The head's prior at `depth` plus one drafter pass, whatever the depth."""
        if self.step_cost is None:
            return None
        from mtpkit.speculative.adaptive import prior_cost

        return prior_cost(depth) + self.step_cost

    def fork(self) -> DFlashProposer:
        import copy

        forked = copy.copy(self)
        forked.stream = self.stream.fork()
        return forked

    def batched(self) -> DFlashRows:
        from mtpkit.speculative.proposers.dflash_rows import DFlashRows

        return DFlashRows(self)


def _load(m: MtpModel, spec: Any, where: Any) -> Any:
    from mtpkit.runtime.dflash import check_target, load_dflash
    from mtpkit.speculative.proposers.target import embedding_rows, share_of

    drafter = load_dflash(where)
    check_target(drafter, m.config, embedding_rows(m), (str(spec), m.path.name))
    share = share_of(m, drafter.parameter_bytes)
    return lambda: DFlashProposer(m, drafter, share)


def _find(spec: Any) -> Any:
    from mtpkit.runtime.dflash import dflash_directory

    return dflash_directory(spec)


KIND = DrafterKind("dflash", _find, _load)
