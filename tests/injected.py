"""Drafts injected into a decoder: right up to a chosen depth each round, then wrong.

Every partial acceptance then happens on purpose, which exercises the rollback of every cache
kind; the output must stay plain decoding's, and exactly the planned number of drafts must be
accepted each round.
"""

from __future__ import annotations

import mlx.core as mx

from mtpkit.spec.decode import MtpDecoder


def inject_drafts(
    decoder: MtpDecoder, reference: list[int], plan: list[int], vocab: int
) -> list[int]:
    """Replace the decoder's drafter: round k drafts `reference`'s next `decoder.depth` tokens
    with the ones from `plan[k]` on made wrong. Returns the list the rounds' plans go into."""
    rights: list[int] = []
    depth = decoder.depth

    def injected_draft(*_: object) -> tuple[mx.array, None]:
        right = plan[len(rights)]
        rights.append(right)
        start = decoder.n_confirmed
        truth = (reference + [0] * 8)[start : start + depth]
        drafts = [t if j < right else (t + 1) % vocab for j, t in enumerate(truth)]
        return mx.array(drafts, dtype=mx.int32), None

    decoder.drafter.draft = injected_draft
    return rights


def accepted_per_round(decoder: MtpDecoder) -> list[int]:
    """Drafts accepted in each round but the last, from where the rounds started."""
    positions = [p for p, _ in decoder.stats.draft_log]
    return [b - a - 1 for a, b in zip(positions, positions[1:], strict=False)]
