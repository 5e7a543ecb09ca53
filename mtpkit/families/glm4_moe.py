"""GLM-4.5/4.6/4.7 and Air (`glm4_moe`): DeepSeek's nextn names at `model.layers.{N}`.

N is `num_hidden_layers` (46, 47, 61, 92 all occur), always read from the config.
"""

from __future__ import annotations

from mtpkit.families.base import register
from mtpkit.families.nextn import NextnFamily


@register
class Glm4Moe(NextnFamily):
    name = "glm4_moe"
    mlx_module = "glm4_moe"
    block_class = "DecoderLayer"
