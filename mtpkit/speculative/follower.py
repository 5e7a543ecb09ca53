"""The decoder's side of a rank without the MTP head (`mtpkit.runtime.ranks`): a non-last
pipeline stage drafts placeholders that rank 0's shared drafts replace, and reads rank 0's
verdict."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class FollowerDrafter:
    """The drafter of a rank without the head (a non-last pipeline stage): it keeps the
    bookkeeping `HeadDrafter` keeps (whether there is a confirmed pair to draft from) and
    drafts placeholders, which `Lockstep.share` replaces with rank 0's drafts."""

    def __init__(self) -> None:
        self.pending = 0  # confirmed pairs the head has not seen yet
        self.ready: mx.array | None = None  # set when a round left a pair to draft from

    @property
    def pending_tokens(self) -> list[int]:
        return [0] * self.pending

    def add(self, hidden: mx.array, tokens: list[int]) -> None:
        self.pending += len(tokens)

    def catch_up(self, keep_last: bool = True) -> None:
        self.pending = min(self.pending, 1) if keep_last else 0

    def can_draft(self) -> bool:
        return self.pending > 0 or self.ready is not None

    def draft(self, depth: int, sampling: Any) -> tuple[mx.array, None]:
        self.pending, self.ready = 0, None
        return mx.zeros((depth,), dtype=mx.int32), None

    def queue(
        self, depth: int, hidden: mx.array, followers: mx.array, launch: bool = True
    ) -> mx.array:
        """A placeholder of the head's output over the round's K+1 pairs."""
        return mx.zeros((1, depth + 1, 1))

    def drop_step0(self, n: int) -> None:
        return None

    def settle(self, out: mx.array, kept: int) -> None:
        self.ready = out[:, kept - 1 : kept]


def placeholder_verdict(depth: int, greedy: bool, logits: mx.array) -> mx.array:
    """The shape `mtpkit.speculative.accept.verdict` packs, computed after `logits` (a rank that
    reads rank 0's verdict)."""
    size = 2 * depth + 1 if greedy else depth + 2
    return mx.depends(mx.zeros((size,), dtype=mx.int32), [logits])


def followers_of(packed: mx.array, depth: int, greedy: bool) -> mx.array:
    """The confirmed token after each verify input [K+1], from a packed verdict
    (`mtpkit.speculative.accept`): what every rank computes from rank 0's shared verdict."""
    if greedy:  # [the K+1 argmaxes, the drafts]
        return packed[: depth + 1]
    kept, token, drafts = packed[0], packed[1], packed[2:]
    positions = mx.arange(depth + 1)
    return mx.where(positions < kept, mx.concatenate([drafts, token[None]]), token)
