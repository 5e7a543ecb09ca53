"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek's nextn layer with MLA attention.

The nextn layer sits at `model.layers.{num_hidden_layers}` (47 in the published model) with
DeepSeek-V3's names (`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, copies of the
embedding and lm_head); its block is an MLA + MoE `Glm4MoeLiteDecoderLayer`, and its
`kv_b_proj` is split as mlx-lm's glm4_moe_lite sanitize splits it. vLLM:
`vllm/model_executor/models/glm4_moe_lite_mtp.py`.
"""

from __future__ import annotations

from mtpkit.families.base import register
from mtpkit.families.deepseek_v3 import DeepseekV3


@register
class Glm4MoeLite(DeepseekV3):
    name = "glm4_moe_lite"
    mlx_module = "glm4_moe_lite"
    block_class = "Glm4MoeLiteDecoderLayer"
