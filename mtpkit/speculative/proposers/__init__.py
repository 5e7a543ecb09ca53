"""The drafters behind the decoder, one file each, all behind one protocol (`base.Proposer`):
the checkpoint's MTP head (`mtp_head`), its placeholder on ranks without the head
(`follower`), a separate draft model (`draft_model`), Gemma 4's assistant
(`gemma4_assistant`), the DFlash block drafter (`dflash`), an EAGLE-3 drafter (`eagle3`), n-gram prompt lookup
(`prompt_lookup`). `choose` picks one from what the user asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtpkit.speculative.proposers.base import (
    Proposal,
    Proposer,
    ProposerBase,
    RowsProposal,
    RowsProposer,
)

if TYPE_CHECKING:
    from mtpkit.runtime.model import MtpModel


def default_proposer(m: MtpModel) -> Proposer:
    """The model's own MTP head (on a rank without it, the follower of rank 0's)."""
    if m.head is not None:
        from mtpkit.speculative.proposers.mtp_head import HeadProposer

        return HeadProposer(m)
    from mtpkit.speculative.proposers.follower import FollowerProposer

    return FollowerProposer()


__all__ = [
    "Proposal",
    "Proposer",
    "ProposerBase",
    "RowsProposal",
    "RowsProposer",
    "default_proposer",
]
