"""DeepSeek-style families: the nextn layers continue the decoder stack.

MTP layer i sits at `model.layers.{num_hidden_layers + i}` (the offset is read from the
config, never written as a literal): `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, a full
decoder block, and copies of `embed_tokens` and `lm_head` (`embed_tokens`,
`shared_head.head`) that need not be pulled or kept.
"""

from __future__ import annotations

from typing import ClassVar

from mtpkit.families.base import Family
from mtpkit.families.head import MtpHead, NextnHead

NEXTN_REQUIRED = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
NEXTN_DUPLICATES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}


class NextnFamily(Family):
    """Families whose MTP layers continue the decoder stack (DeepSeek-V3, GLM-4.5+)."""

    required_mtp_tensors = NEXTN_REQUIRED
    raw_layer_root: ClassVar[str | None] = "model.layers.{layer}."
    duplicates: ClassVar[dict[str, str]] = NEXTN_DUPLICATES
    head_class: ClassVar[type[MtpHead]] = NextnHead

    def mtp_layer_offset(self) -> int:
        return self.num_hidden_layers
