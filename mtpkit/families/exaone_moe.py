"""EXAONE MoE (`exaone_moe`, K-EXAONE): a Qwen-style head at top-level `mtp.*`.

`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.norm` and
`mtp.layers.{i}.*` (mlx-lm's `exaone_moe` sanitize drops every `mtp.` key). The step, as
vLLM's `exaone_moe_mtp.py` runs it: `norm(layer(fc(concat(pre_fc_norm_embedding(embed),
pre_fc_norm_hidden(h)))))`, embedding first, depth d on layer `d % num_layers`. Norms are plain.

The MTP layer is the family's decoder layer with two differences vLLM's `is_mtp` makes: its
MLP is always the dense one (`intermediate_size`), and its attention type is
`mtp_layer_types[i]` when the config has that list (else `layer_types[i]`). A sliding-window
MTP layer keeps a full KV cache and a windowed mask (`MtpHead.window_size`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.head import QWEN_REQUIRED, MtpHead, QwenHead


class ExaoneHead(QwenHead):
    """The Qwen-style head (fc, pre_fc_norm_*, norm) around EXAONE's own decoder layers."""

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__(args, block, num_layers)
        self._windows = [
            args.sliding_window if layer.is_sliding_window else None for layer in self.layers
        ]

    def build_layers(self, args: Any, block: type[nn.Module], num_layers: int) -> list[nn.Module]:
        types = getattr(args, "mtp_layer_types", None) or args.layer_types
        layers = []
        for i in range(num_layers):
            # Layer i is built as a backbone layer whose MLP is dense and whose attention
            # type is the MTP layer's; the backbone's list still decides whether every
            # layer ropes (mlx-lm's `apply_rope_all_layers`).
            layer_types = list(args.layer_types)
            layer_types[i] = types[i % len(types)]
            is_moe = list(args.is_moe_layer)
            is_moe[i] = False
            layer_args = dataclasses.replace(args, layer_types=layer_types, is_moe_layer=is_moe)
            layers.append(block(layer_args, i))
        return layers

    def window_size(self, i: int) -> int | None:
        return self._windows[i]


@register
class ExaoneMoe(Family):
    name = "exaone_moe"
    required_mtp_tensors = QWEN_REQUIRED
    raw_head_roots: ClassVar[tuple[str, ...]] = ("mtp.",)
    head_class: ClassVar[type[MtpHead]] = ExaoneHead
    mlx_module = "exaone_moe"
    block_class = "DecoderLayer"

    def head_args(self, model: Any = None) -> Any:
        # mlx-lm's ModelArgs has no `mtp_layer_types`: carry it on a copy of the args.
        args = dataclasses.replace(super().head_args(model))
        args.mtp_layer_types = self.text_config.get("mtp_layer_types")
        return args

    def rename_backbone(self, name: str) -> str | None:
        # mlx-lm's sanitize moves the router's score-correction bias into the gate module.
        if name.endswith(".mlp.e_score_correction_bias"):
            name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return super().rename_backbone(name)
