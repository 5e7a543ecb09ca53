"""Qwen2 / Qwen2.5 (`qwen2`): a dense decoder that ships no MTP head; `mtpkit train-head`
trains one (`mtpkit.families.dense`).
"""

from __future__ import annotations

from mtpkit.families.base import register
from mtpkit.families.dense import DenseFamily


@register
class Qwen2(DenseFamily):
    name = "qwen2"
    mlx_module = "qwen2"
