"""Qwen3-Next (`qwen3_next`): head at top-level `mtp.*`, per-expert experts, zero-centred norms.

The published config has no MTP field (vLLM assumes one layer); tools that graft the head
write `num_nextn_predict_layers: 1`, which is what mtpkit reads and writes.
"""

from __future__ import annotations

from typing import Any

from mtpkit.families.qwen3_5 import QwenMtpNames


class Qwen3Next(QwenMtpNames):
    name = "qwen3_next"
    head_prefix = "mtp."

    def decoder_layer_class(self) -> Any:
        from mtpkit.quant import mlx_lm_models

        return mlx_lm_models("qwen3_next").Qwen3NextDecoderLayer
