"""Qwen3.5 / Qwen3.6 (dense `qwen3_5`, MoE `qwen3_5_moe`).

Raw checkpoints keep the head at top-level `mtp.*` next to `model.language_model.*`;
mlx-lm PR #990 and the "-MTP" community builds call it `language_model.mtp.*`, and so does
mtpkit. Norms are zero-centred (the model applies 1 + w).
"""

from __future__ import annotations

import re
from typing import ClassVar

from mtpkit.families.base import Family

QWEN_MTP_ROOT = re.compile(r"^(?P<root>(?:model\.)?(?:language_model\.)?mtp\.)")

QWEN_REQUIRED = (
    "fc.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
)


class QwenMtpNames(Family):
    """Name rules shared by Qwen3.5/3.6 and Qwen3-Next: one `mtp.` root per checkpoint."""

    zero_centred_norms = True
    required_mtp_tensors = QWEN_REQUIRED

    def is_mtp_tensor(self, name: str) -> bool:
        return QWEN_MTP_ROOT.match(name) is not None

    def mtp_layer_prefix(self, name: str) -> str | None:
        m = QWEN_MTP_ROOT.match(name)
        return m["root"] if m else None


class Qwen3_5(QwenMtpNames):
    name = "qwen3_5"
    aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_text",)
    head_prefix = "language_model.mtp."

    def mtp_field(self) -> str:
        return "text_config.mtp_num_hidden_layers"

    def declared_mtp_layers(self) -> int | None:
        value = self.text_config.get("mtp_num_hidden_layers")
        if value is None:
            value = self.config.get("mtp_num_hidden_layers")
        return None if value is None else int(value)


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text",)
