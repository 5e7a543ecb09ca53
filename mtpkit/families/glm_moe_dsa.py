"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's layer (MLA + DSA indexer + MoE) with GLM's config.

mlx-lm runs it as its deepseek_v32 model with `rope_parameters` read into the rope settings,
so the head's block is `deepseek_v32.DeepseekV32DecoderLayer` built from glm_moe_dsa's args.
The nextn layers sit at `model.layers.{num_hidden_layers + i}` (78 in GLM-5).
"""

from __future__ import annotations

from typing import Any

from mtpkit.families.base import register
from mtpkit.families.deepseek_v32 import DeepseekV32
from mtpkit.mlxlm import mlx_lm_models


@register
class GlmMoeDsa(DeepseekV32):
    name = "glm_moe_dsa"
    mlx_module = "glm_moe_dsa"
    block_module = "deepseek_v32"

    def head_block(self) -> type[Any]:
        return getattr(mlx_lm_models(self.block_module), self.block_class)
