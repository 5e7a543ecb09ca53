"""Step-3.5 (`step3p5`, Step-3.5-Flash): nextn layers past the trunk, zero-centred norms.

MTP layer i sits at `model.layers.{num_hidden_layers + i}` (mlx-lm's `step3p5` sanitize drops
those layers and every `.mtp` key): `enorm`, `hnorm`, `eh_proj`,
`transformer.shared_head.norm`, `transformer.shared_head.output` (a copy of the lm_head,
not kept) and a decoder block whose attention type, rotary fraction, rope base and MLP
(dense unless `moe_layers_enum` lists the layer) come from the config's per-layer lists,
which run past the trunk over the MTP layers. The step, as vLLM's `step3p5_mtp.py` runs it:
`shared_head.norm(block(eh_proj(concat(enorm(embed), hnorm(h)))))`, embedding first, depth d
on layer `d % num_layers`. Every norm is a GemmaRMSNorm (the model applies 1 + w), so
converting shifts them all, the head's and the backbone's (mlx-lm shifts every backbone
`*norm*.weight`). The block is mlx-lm's `Step3p5DecoderLayer` built at its true index.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from mtpkit.core.errors import MtpkitError
from mtpkit.families.base import register
from mtpkit.families.head import MtpHead, NextnHead
from mtpkit.families.nextn import NextnFamily

# mlx-lm's sanitize renames, first match wins (`step3p5.Model.sanitize`).
BACKBONE_RENAMES = (
    (".moe.gate_proj.", ".mlp.switch_mlp.gate_proj."),
    (".moe.up_proj.", ".mlp.switch_mlp.up_proj."),
    (".moe.down_proj.", ".mlp.switch_mlp.down_proj."),
    (".moe.gate.", ".mlp.gate.gate."),
    (".moe.router_bias", ".mlp.gate.router_bias"),
    (".share_expert.", ".mlp.share_expert."),
)
NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
# Config lists with one entry per layer, the trunk's then the MTP layers'.
PER_LAYER_FIELDS = (
    "layer_types",
    "rope_theta",
    "partial_rotary_factors",
    "swiglu_limits",
    "swiglu_limits_shared",
)
# vLLM strips a `transformer.` segment from the nextn layer's names.
TRANSFORMER = re.compile(r"^(layers\.\d+\.)transformer\.")


class Step3p5Head(NextnHead):
    """DeepSeek-style nextn layers around mlx-lm's Step-3.5 block; a sliding-window layer
    attends through a windowed mask over the head's full cache."""

    def __init__(self, args: Any, block: Any, num_layers: int) -> None:
        needed = args.num_hidden_layers + num_layers
        if args.layer_types and len(args.layer_types) < needed:
            raise MtpkitError(
                f"config layer_types has {len(args.layer_types)} entries; the MTP layers need "
                f"{needed} (the trunk's and one per MTP layer, as Step-3.5's configs have)"
            )
        super().__init__(args, block, num_layers)
        self._windows = [args.sliding_window if layer.is_sliding else None for layer in self.layers]

    def window_size(self, i: int) -> int | None:
        return self._windows[i]


@register
class Step3p5(NextnFamily):
    name = "step3p5"
    zero_centred_norms = True
    backbone_norm_suffixes = (*NORMS, "model.norm.weight")
    head_norm_suffixes = (*NORMS, ".enorm.weight", ".hnorm.weight", ".shared_head.norm.weight")
    required_mtp_tensors = (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    duplicates: ClassVar[dict[str, str]] = {
        "transformer.shared_head.output.weight": "lm_head.weight",
        "shared_head.output.weight": "lm_head.weight",
        "embed_tokens.weight": "model.embed_tokens.weight",
    }
    head_class: ClassVar[type[MtpHead]] = Step3p5Head
    mlx_module = "step3p5"
    block_class = "Step3p5DecoderLayer"

    @property
    def num_experts(self) -> int:
        return int(self.text_config.get("moe_num_experts") or 0)

    def declare_mtp(self, config: dict[str, Any], layers: int) -> None:
        """Also cut the per-layer lists to trunk + `layers` entries (transformers refuses a
        `layer_types` of another length), as for a head with fewer layers than the source's."""
        super().declare_mtp(config, layers)
        total = self.num_hidden_layers + layers
        for key in PER_LAYER_FIELDS:
            if isinstance(config.get(key), list) and len(config[key]) > total:
                config[key] = config[key][:total]

    def head_relative(self, name: str) -> str | None:
        relative = super().head_relative(name)
        return None if relative is None else TRANSFORMER.sub(r"\1", relative)

    def rename_backbone(self, name: str) -> str | None:
        if ".mtp" in name:  # mlx-lm's sanitize drops these too
            return None
        for src, dst in BACKBONE_RENAMES:
            if src in name and dst not in name:
                name = name.replace(src, dst)
                break
        return super().rename_backbone(name)
