"""Ling-3 (`bailing_moe_v3`): Kimi-delta-attention + MLA hybrid, MTP layers appended.

MTP layer i sits at `model.layers.{num_hidden_layers + i}` (mlx-lm's sanitize drops every
layer from `num_hidden_layers` on; vLLM `bailing_moe_v3_mtp.py` loads them): `enorm`,
`hnorm`, `eh_proj`, a full decoder layer past the hybrid pattern (so an MLA attention
`attention.*` and a MoE `mlp.*`), and `final_layernorm`; the embedding and the lm_head are
the backbone's (vLLM loads `model.word_embeddings` and `lm_head` into the draft model).
The step is DeepSeek's with the embedding first: `eh_proj(concat(enorm(embed), hnorm(h)))`,
then the block, then `final_layernorm` and the shared lm_head; depth cycles through the
layers (`step % num_nextn_predict_layers`). Norms are plain. The block is mlx-lm's
`BailingDecoderLayer` at its true index; MLA's `kv_b_proj` is split as its sanitize splits it.

The backbone's KDA layers keep three conv states and a recurrent state per layer, which a
rejected draft must not leave behind: `mtpkit.runtime.rollback.replay` rolls them back.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.deepseek_v3 import DeepseekV3
from mtpkit.families.head import MtpHead

BAILING_REQUIRED = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "final_layernorm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def bailing_mtp_layer_class(block: type[nn.Module]) -> type[nn.Module]:
    """mlx-lm's Bailing decoder layer with the MTP projection and norms attached."""

    class BailingMtpLayer(block):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, layer_idx: int) -> None:
            super().__init__(args, layer_idx)
            h, eps = args.hidden_size, args.rms_norm_eps
            self.enorm = nn.RMSNorm(h, eps=eps)
            self.hnorm = nn.RMSNorm(h, eps=eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.final_layernorm = nn.RMSNorm(h, eps=eps)

    BailingMtpLayer.__name__ = f"Mtp{block.__name__}"
    return BailingMtpLayer


class BailingHead(MtpHead):
    """enorm, hnorm, eh_proj and final_layernorm inside each MTP layer, around an MLA + MoE
    decoder layer of the backbone's class."""

    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "enorm",
        "norm_hidden": "hnorm",
        "projection": "eh_proj",
        "final_norm": "final_layernorm",
    }
    mask_as_array = True  # the Bailing MLA takes an array mask

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        layer_cls = bailing_mtp_layer_class(block)
        # Layers past num_hidden_layers are full-attention (MLA) and MoE in mlx-lm's own rule.
        self.layers = [layer_cls(args, args.num_hidden_layers + i) for i in range(num_layers)]


class BailingFamily(Family):
    """Families whose MTP layers are appended after the base ones with Bailing's names."""

    config_field = "num_nextn_predict_layers"
    raw_layer_root: ClassVar[str | None] = "model.layers.{layer}."
    # vLLM loads these from the backbone; a checkpoint that repeats them needs no copy.
    duplicates: ClassVar[dict[str, str]] = {
        "embed_tokens.weight": "model.word_embeddings.weight",
        "shared_head.head.weight": "lm_head.weight",
    }
    required_mtp_tensors = BAILING_REQUIRED
    head_class: ClassVar[type[MtpHead]] = BailingHead
    embedding_attr = "word_embeddings"
    split_tensor = DeepseekV3.split_tensor

    def mtp_layer_offset(self) -> int:
        return self.num_hidden_layers


@register
class BailingMoeV3(BailingFamily):
    name = "bailing_moe_v3"
    # KDA's q/k/v conv1d weights are [C, 1, K] in the raw checkpoint (mlx-lm moves the axis).
    has_conv1d = True
    mlx_module = "bailing_moe_v3"
    block_class = "BailingDecoderLayer"
