"""GLM-4.5/4.6/4.7 and Air (`glm4_moe`): DeepSeek's nextn names at `model.layers.{N}`.

N is `num_hidden_layers` (46, 47, 61, 92 all occur), always read from the config.
"""

from __future__ import annotations

from typing import Any

from mtpkit.families.deepseek_v3 import NextnLayerFamily


class Glm4Moe(NextnLayerFamily):
    name = "glm4_moe"

    def decoder_layer_class(self) -> Any:
        from mtpkit.quant import mlx_lm_models

        return mlx_lm_models("glm4_moe").DecoderLayer
