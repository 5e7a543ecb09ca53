"""Qwen3 dense (`qwen3`): ships no MTP head; `mtpkit train-head` trains one
(`mtpkit.families.dense`).
"""

from __future__ import annotations

from mtpkit.families.base import register
from mtpkit.families.dense import DenseFamily


@register
class Qwen3(DenseFamily):
    name = "qwen3"
    mlx_module = "qwen3"
