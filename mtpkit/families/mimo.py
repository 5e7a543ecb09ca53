"""MiMo (`mimo`): `model.mtp_layers.{i}` with a Qwen2 block; the hidden state comes first.

`input_proj(concat(hidden_layernorm(h), token_layernorm(embed)))`, the reverse of the
DeepSeek/Qwen order. Norms are plain.
"""

from __future__ import annotations

import re

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
