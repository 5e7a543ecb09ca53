"""MiMo (`mimo`): `model.mtp_layers.{i}` with a Qwen2 block; the hidden state comes first.

`input_proj(concat(hidden_layernorm(h), token_layernorm(embed)))`, the reverse of the
DeepSeek/Qwen order. Norms are plain.
"""

from __future__ import annotations

import re
from typing import Any

from mtpkit.families.base import Family

MIMO_ROOT = re.compile(r"^(?P<root>model\.mtp_layers\.\d+\.|mtp\.layers\.\d+\.)")


class Mimo(Family):
    name = "mimo"
    concat_order = "hidden_first"
    head_prefix = "mtp."
    required_mtp_tensors = (
        "token_layernorm.weight",
        "hidden_layernorm.weight",
        "input_proj.weight",
        "final_layernorm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )

    def is_mtp_tensor(self, name: str) -> bool:
        return MIMO_ROOT.match(name) is not None

    def mtp_layer_prefix(self, name: str) -> str | None:
        m = MIMO_ROOT.match(name)
        return m["root"] if m else None

    def rename_head(self, name: str) -> str:
        m = MIMO_ROOT.match(name)
        assert m is not None, name
        index = m["root"].rstrip(".").rsplit(".", 1)[1]
        return f"{self.head_prefix}layers.{index}.{name[m.end() :]}"

    def head_module(self, model: Any, layers: int) -> Any:
        import mlx.nn as nn

        from mtpkit.families.qwen3_5 import _rooted
        from mtpkit.quant import mlx_lm_models

        TransformerBlock = mlx_lm_models("mimo").TransformerBlock

        args = model.args
        hidden = args.hidden_size
        blocks = []
        for _ in range(layers):
            layer = TransformerBlock(args)
            layer.token_layernorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
            layer.hidden_layernorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
            layer.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.final_layernorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
            blocks.append(layer)
        head = nn.Module()
        head.layers = blocks
        return _rooted(head, self.head_prefix)
