"""Qwen3.5 / Qwen3.6 (dense `qwen3_5`, MoE `qwen3_5_moe`).

Raw checkpoints keep the head at top-level `mtp.*` next to `model.language_model.*`;
mlx-lm PR #990 and the "-MTP" community builds call it `language_model.mtp.*`, and so does
mtpkit. Norms are zero-centred (the model applies 1 + w).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

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
    """Name rules shared by Qwen3.5/3.6 and Qwen3-Next: one `mtp.` root per checkpoint."""

    zero_centred_norms = True
    required_mtp_tensors = QWEN_REQUIRED
    backbone_norm_suffixes = QWEN_BACKBONE_NORMS
    head_norm_suffixes = QWEN_HEAD_NORMS
    has_conv1d = True

    def rename_head(self, name: str) -> str:
        m = QWEN_MTP_ROOT.match(name)
        assert m is not None, name
        return self.head_prefix + name[m.end() :]

    def head_module(self, model: Any, layers: int) -> Any:
        import mlx.nn as nn

        args = self.text_model(model).args
        hidden = args.hidden_size
        head = nn.Module()
        head.fc = nn.Linear(2 * hidden, hidden, bias=False)
        head.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        head.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        head.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        # The MTP block is a full-attention layer, whatever the backbone's layer pattern.
        full_attention = args.full_attention_interval - 1
        head.layers = [self.decoder_layer_class()(args, full_attention) for _ in range(layers)]
        return _rooted(head, self.head_prefix)

    def text_model(self, model: Any) -> Any:
        return model

    def decoder_layer_class(self) -> Any:
        raise NotImplementedError

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

    def decoder_layer_class(self) -> Any:
        from mtpkit.quant import mlx_lm_models

        return mlx_lm_models("qwen3_5").DecoderLayer

    def declared_mtp_layers(self) -> int | None:
        value = self.text_config.get("mtp_num_hidden_layers")
        if value is None:
            value = self.config.get("mtp_num_hidden_layers")
        return None if value is None else int(value)


class Qwen3_5Moe(Qwen3_5):
    name = "qwen3_5_moe"
    aliases: ClassVar[tuple[str, ...]] = ("qwen3_5_moe_text",)


def _rooted(module: Any, prefix: str) -> Any:
    """Nest `module` under the dotted `prefix` (e.g. `language_model.mtp.`)."""
    import mlx.nn as nn

    for part in reversed(prefix.rstrip(".").split(".")):
        parent = nn.Module()
        setattr(parent, part, module)
        module = parent
    return module
