"""DeepSeek-V3/R1/V3.1 (`deepseek_v3`): the nextn layer follows the last decoder layer.

Its tensors sit at `model.layers.{num_hidden_layers + i}`: `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, a full decoder block, and copies of `embed_tokens` and `lm_head`
(`embed_tokens`, `shared_head.head`) that need not be pulled or kept.
"""

from __future__ import annotations

import re
from typing import ClassVar

from mtpkit.families.base import Family

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


class NextnLayerFamily(Family):
    """Families whose MTP layers continue the decoder stack (DeepSeek-V3, GLM-4.5+)."""

    required_mtp_tensors = NEXTN_REQUIRED
    head_prefix = "mtp."

    @property
    def layer_pattern(self) -> re.Pattern[str]:
        return re.compile(r"^(?P<root>model\.layers\.(?P<layer>\d+)\.|mtp\.layers\.\d+\.)")

    def mtp_layer_prefix(self, name: str) -> str | None:
        m = self.layer_pattern.match(name)
        if m is None:
            return None
        if m["layer"] is not None and int(m["layer"]) < self.num_hidden_layers:
            return None
        return m["root"]

    def is_mtp_tensor(self, name: str) -> bool:
        return self.mtp_layer_prefix(name) is not None

    def duplicate_of(self, name: str) -> str | None:
        root = self.mtp_layer_prefix(name)
        if root is None:
            return None
        return NEXTN_DUPLICATES.get(name[len(root) :])


class DeepseekV3(NextnLayerFamily):
    name = "deepseek_v3"
    aliases: ClassVar[tuple[str, ...]] = ("kimi_k2",)
