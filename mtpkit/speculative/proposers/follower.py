"""The proposer of a rank without the MTP head (a non-last pipeline stage,
`mtpkit.runtime.ranks`): it drafts placeholders that rank 0's shared drafts replace, and
reads rank 0's verdict."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.speculative.accept import Verdict
from mtpkit.speculative.proposers.base import Proposal, ProposerBase


class FollowerProposer(ProposerBase):
    """Keeps the bookkeeping `HeadProposer` keeps (whether there is a confirmed pair to draft
    from) and drafts placeholders, which `Lockstep.share` replaces with rank 0's drafts."""

    name = "mtp"
    looks_ahead = True
    drafts_locally = False

    def __init__(self) -> None:
        self.pending = 0  # confirmed pairs the head has not seen yet
        self.ready = False  # a round left a pair to draft from

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        self.pending += len(tokens)

    def end_prefill(self) -> None:
        self.pending = min(self.pending, 1)

    def can_propose(self) -> bool:
        return self.pending > 0 or self.ready

    def propose(self, depth: int, sampling: Any) -> Proposal:
        self.pending, self.ready = 0, False
        return Proposal(mx.zeros((depth,), dtype=mx.int32))

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> None:
        return None

    def assume_kept(self, state: Any) -> None:
        self.ready = True

    def settle(self, state: Any, verdict: Verdict, premise_held: bool) -> None:
        self.ready = True
