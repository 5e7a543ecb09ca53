"""Qwen3.5 / Qwen3.6 (dense `qwen3_5`, MoE `qwen3_5_moe`).

Raw checkpoints keep the head at top-level `mtp.*` next to `model.language_model.*`;
mlx-lm PR #990 and the "-MTP" community builds call it `language_model.mtp.*`, and so does
mtpkit. Norms are zero-centred (the model applies 1 + w).
"""

from __future__ import annotations

from typing import Any, ClassVar

from mtpkit.families.base import Family, register
from mtpkit.families.head import QWEN_REQUIRED, MtpHead, QwenHead

# mlx-lm's qwen3_5/qwen3_next sanitize shifts exactly these (1-D) backbone norms; the gated
# delta net's `linear_attn.norm` is not zero-centred and is never shifted.
QWEN_BACKBONE_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
QWEN_HEAD_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
)


class QwenMtpNames(Family):
    """Names and head shared by Qwen3.5/3.6 and Qwen3-Next: one `mtp.` root per checkpoint."""

    zero_centred_norms = True
    required_mtp_tensors = QWEN_REQUIRED
    backbone_norm_suffixes = QWEN_BACKBONE_NORMS
    head_norm_suffixes = QWEN_HEAD_NORMS
    has_conv1d = True
    raw_head_roots: ClassVar[tuple[str, ...]] = (
        "model.language_model.mtp.",
        "language_model.mtp.",
        "model.mtp.",
        "mtp.",
    )
    head_class: ClassVar[type[MtpHead]] = QwenHead


@register
class Qwen3_5(QwenMtpNames):
    name = "qwen3_5"
    aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_text",)
    head_prefix = "language_model.mtp."
    inline_layout = True
    head_prefixes: ClassVar[tuple[str, ...]] = (
        "language_model.mtp.",
        "model.language_model.mtp.",
        "mtp.",
    )
    config_field = "text_config.mtp_num_hidden_layers"
    mlx_module = "qwen3_5"
    block_class = "DecoderLayer"
    args_class = "TextModelArgs"

    def rename_backbone(self, name: str) -> str | None:
        # mlx-lm's qwen3_5 Model.sanitize: the vision tower is dropped, the text model moves
        # under `language_model.`.
        if name.startswith(("vision_tower", "model.visual")):
            return None
        if name.startswith("model.language_model"):
            name = name.replace("model.language_model", "language_model.model", 1)
        elif not name.startswith("language_model."):
            name = "language_model." + name
        if self.tie_word_embeddings and name == "language_model.lm_head.weight":
            return None
        return super().rename_backbone(name)

    def declare_mtp(self, config: dict[str, Any], layers: int) -> None:
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["mtp_num_hidden_layers"] = layers
        if "text_config" not in config or "mtp_num_hidden_layers" in config:
            config["mtp_num_hidden_layers"] = layers

    def text_model(self, model: Any) -> Any:
        return model.language_model

    def args_config(self) -> dict[str, Any]:
        return dict(self.text_config)


@register
class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text",)
