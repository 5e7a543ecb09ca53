"""Facts of the target a drafter is loaded against (`--draft-model DIR`): the token ids its
embedding has rows for, the width of its logits, and the bytes of its backbone (a drafter's
cost is quoted as a share of them)."""

from __future__ import annotations

import mlx.core as mx

from mtpkit.runtime.headload import parameter_bytes
from mtpkit.runtime.model import MtpModel


def embedding_rows(m: MtpModel) -> int:
    """The token ids the target's embedding has rows for."""
    weight = getattr(m.embedding, "weight", None)  # quantized too: [V, packed]
    return int(weight.shape[0]) if weight is not None else logits_width(m)


def logits_width(m: MtpModel) -> int:
    """The width of the target's logits (a probe of one token through its output head)."""
    width = m.lm_head(mx.zeros((1, 1, m.embed(mx.array([[0]])).shape[-1]))).shape[-1]
    return int(width)


def share_of(m: MtpModel, drafter_bytes: int) -> float:
    """A drafter's bytes as a share of the target backbone's (its step's prior cost)."""
    return drafter_bytes / max(1, parameter_bytes(m.model))
