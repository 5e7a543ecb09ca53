"""MiMo (`mimo`): `model.mtp_layers.{i}` with a Qwen2 block; the hidden state comes first.

`input_proj(concat(hidden_layernorm(h), token_layernorm(embed)))`, the reverse of the
DeepSeek/Qwen order. Norms are plain. The published head has no `input_proj.bias`; a head
that carries one gets a biased projection, in conversion and at run time alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.head import HIDDEN_FIRST, MtpHead


def mimo_layer_class(block: type[nn.Module], proj_bias: bool) -> type[nn.Module]:
    """mlx-lm's MiMo block with the MTP projection and norms attached."""

    class MimoMtpLayer(block):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            h, eps = args.hidden_size, args.rms_norm_eps
            self.token_layernorm = nn.RMSNorm(h, eps=eps)
            self.hidden_layernorm = nn.RMSNorm(h, eps=eps)
            self.input_proj = nn.Linear(2 * h, h, bias=proj_bias)
            self.final_layernorm = nn.RMSNorm(h, eps=eps)

    return MimoMtpLayer


class MimoHead(MtpHead):
    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "token_layernorm",
        "norm_hidden": "hidden_layernorm",
        "projection": "input_proj",
        "final_norm": "final_layernorm",
    }
    default_concat_order = HIDDEN_FIRST

    def __init__(
        self, args: Any, block: type[nn.Module], num_layers: int, proj_bias: bool = False
    ) -> None:
        super().__init__()
        layer_cls = mimo_layer_class(block, proj_bias)
        self.layers = [layer_cls(args) for _ in range(num_layers)]

    @classmethod
    def build(
        cls, args: Any, block: type[nn.Module], num_layers: int, names: Iterable[str] = ()
    ) -> MtpHead:
        proj_bias = any(n.endswith("input_proj.bias") for n in names)
        return cls(args, block, num_layers, proj_bias)


@register
class Mimo(Family):
    name = "mimo"
    concat_order = "hidden_first"
    required_mtp_tensors = (
        "token_layernorm.weight",
        "hidden_layernorm.weight",
        "input_proj.weight",
        "final_layernorm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    raw_layer_root: ClassVar[str | None] = "model.mtp_layers.{layer}."
    head_class: ClassVar[type[MtpHead]] = MimoHead
    mlx_module = "mimo"
    block_class = "TransformerBlock"
