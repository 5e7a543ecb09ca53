"""Drafts injected into a decoder: right up to a chosen depth each round, then wrong.

Every partial acceptance then happens on purpose, which exercises the rollback of every cache
kind; the output must stay plain decoding's, and exactly the planned number of drafts must be
accepted each round. The drafts go through the decoder's `draft_filter` (after the head has
drafted), keyed by the round's position, so that a pipelined round (queued before the previous
verdict is read, maybe discarded) gets the same plan as a serial one at that position.
"""

from __future__ import annotations

import mlx.core as mx

from mtpkit.speculative.decode import MtpDecoder


def inject_drafts(
    decoder: MtpDecoder, reference: list[int], plan: list[int], vocab: int
) -> dict[int, int]:
    """Round k (the k-th new position asked for) drafts `reference`'s next `decoder.depth`
    tokens, made wrong from `plan[k]` on. Returns {position: drafts planned right}."""
    rights: dict[int, int] = {}
    depth = decoder.depth
    prompt_length = len(decoder.prompt)

    def injected(position: int, head_drafts: mx.array) -> mx.array:
        right = rights.setdefault(position, plan[len(rights)])
        start = position - prompt_length
        truth = (reference + [0] * 8)[start : start + depth]
        drafts = [t if j < right else (t + 1) % vocab for j, t in enumerate(truth)]
        # The head's drafts stay in the graph (never negative), as a real round computes them.
        return mx.where(head_drafts < 0, head_drafts, mx.array(drafts, dtype=mx.int32))

    decoder.draft_filter = injected
    return rights


def accepted_per_round(decoder: MtpDecoder) -> list[int]:
    """Drafts accepted in each round but the last, from where the rounds started."""
    positions = [p for p, _ in decoder.stats.draft_log]
    return [b - a - 1 for a, b in zip(positions, positions[1:], strict=False)]


def planned_per_round(decoder: MtpDecoder, rights: dict[int, int]) -> list[int]:
    """The plan of each round that counted (in the order of `accepted_per_round`)."""
    return [rights[p] for p, _ in decoder.stats.draft_log[:-1]]
