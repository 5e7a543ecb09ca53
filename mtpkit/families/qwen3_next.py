"""Qwen3-Next (`qwen3_next`): head at top-level `mtp.*`, per-expert experts, zero-centred norms.

The published config has no MTP field (vLLM assumes one layer); tools that graft the head
write `num_nextn_predict_layers: 1`, which is what mtpkit reads and writes.
"""

from __future__ import annotations

from typing import ClassVar

from mtpkit.families.base import register
from mtpkit.families.qwen3_5 import QwenMtpNames


@register
class Qwen3Next(QwenMtpNames):
    name = "qwen3_next"
    declared_upstream = False
    head_prefixes: ClassVar[tuple[str, ...]] = ("mtp.", "model.mtp.")
    mlx_module = "qwen3_next"
    block_class = "Qwen3NextDecoderLayer"
