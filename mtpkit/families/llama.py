"""Llama (`llama`, and `mistral` through mlx-lm's MODEL_REMAPPING): a dense decoder
that ships no MTP head; `mtpkit train-head` trains one (`mtpkit.families.dense`).
"""

from __future__ import annotations

from mtpkit.families.base import register
from mtpkit.families.dense import DenseFamily


@register
class Llama(DenseFamily):
    name = "llama"
    mlx_module = "llama"
