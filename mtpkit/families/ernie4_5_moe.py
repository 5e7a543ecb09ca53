"""ERNIE-4.5 MoE (`ernie4_5_moe`): four per-depth lists under `model.`, one per role.

MTP layer i of a raw checkpoint is spread over `model.mtp_emb_norm.{i}`,
`model.mtp_hidden_norm.{i}`, `model.mtp_linear_proj.{i}` and the decoder block
`model.mtp_block.{i}.*` (mlx-lm's `ernie4_5_moe` sanitize drops exactly these four); mtpkit
keeps them as `mtp.layers.{i}.{mtp_emb_norm,mtp_hidden_norm,mtp_linear_proj,<block>}`.

The step, as vLLM's `ernie_mtp.py` and SGLang's `ernie4_eagle.py` run it:
`block(mtp_linear_proj(concat(mtp_emb_norm(embed), mtp_hidden_norm(h))))`, embedding first,
and the lm_head reads the block output with no norm in between (ERNIE's Paddle training
pipeline runs its outputs through the trunk's final norm instead; the inference engines,
which this head follows, do not). The block is the family's decoder layer built at index i,
as Paddle builds it: below `moe_layer_start_index` (1 in every published config) that is a
dense layer. Norms are plain; vLLM runs only depth 0 of the published single layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.head import MtpHead

# Raw role lists: `model.{role}.{i}.{rest}`; the block's tensors go straight into layer i.
ERNIE_ROLES = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj")
ERNIE_RAW = re.compile(r"^model\.(?P<role>mtp_block|mtp_emb_norm|mtp_hidden_norm|mtp_linear_proj)"
                       r"\.(?P<layer>\d+)\.(?P<rest>.+)$")  # fmt: skip
CONVERTED = re.compile(r"^mtp\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


class NoFinalNorm(nn.Module):
    """The lm_head reads the block output as it is (vLLM's and SGLang's ERNIE step)."""

    def __call__(self, x: mx.array) -> mx.array:
        return x


def ernie_layer_class(block: type[nn.Module], proj_bias: bool) -> type[nn.Module]:
    """mlx-lm's ERNIE decoder layer with the MTP projection and norms attached."""

    class ErnieMtpLayer(block):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, layer_idx: int) -> None:
            super().__init__(args, layer_idx)
            h, eps = args.hidden_size, args.rms_norm_eps
            self.mtp_emb_norm = nn.RMSNorm(h, eps=eps)
            self.mtp_hidden_norm = nn.RMSNorm(h, eps=eps)
            self.mtp_linear_proj = nn.Linear(2 * h, h, bias=proj_bias)

    return ErnieMtpLayer


class ErnieHead(MtpHead):
    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "mtp_emb_norm",
        "norm_hidden": "mtp_hidden_norm",
        "projection": "mtp_linear_proj",
    }

    def __init__(
        self, args: Any, block: type[nn.Module], num_layers: int, proj_bias: bool = False
    ) -> None:
        super().__init__()
        layer_cls = ernie_layer_class(block, proj_bias)
        self.layers = [layer_cls(args, i) for i in range(num_layers)]

    @classmethod
    def build(
        cls, args: Any, block: type[nn.Module], num_layers: int, names: Iterable[str] = ()
    ) -> MtpHead:
        # Paddle gives the projection a bias when the model has `use_bias`.
        proj_bias = any(n.endswith("mtp_linear_proj.bias") for n in names)
        return cls(args, block, num_layers, proj_bias or bool(getattr(args, "use_bias", False)))

    def final_norm(self, i: int) -> nn.Module:
        return NoFinalNorm()


@register
class Ernie4_5Moe(Family):
    name = "ernie4_5_moe"
    required_mtp_tensors = (
        "mtp_emb_norm.weight",
        "mtp_hidden_norm.weight",
        "mtp_linear_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    )
    head_class: ClassVar[type[MtpHead]] = ErnieHead
    mlx_module = "ernie4_5_moe"
    block_class = "Ernie4_5_DecoderLayer"

    @property
    def num_experts(self) -> int:
        return int(self.text_config.get("moe_num_experts") or 0)

    # -- names: four raw roots per layer instead of one ---------------------------------
    def head_relative(self, name: str) -> str | None:
        if m := ERNIE_RAW.match(name):
            role = "" if m["role"] == "mtp_block" else f"{m['role']}."
            return f"layers.{m['layer']}.{role}{m['rest']}"
        if m := CONVERTED.match(name):
            return f"layers.{m['layer']}.{m['rest']}"
        return None

    def is_mtp_tensor(self, name: str) -> bool:
        return self.head_relative(name) is not None

    def mtp_layer_prefix(self, name: str) -> str | None:
        relative = self.head_relative(name)
        return None if relative is None else ".".join(relative.split(".")[:2]) + "."

    def duplicate_of(self, name: str) -> str | None:
        return None

    def raw_head_tensors(self, names: Iterable[str]) -> dict[str, str]:
        return {n: rel for n in names if ERNIE_RAW.match(n) and (rel := self.head_relative(n))}

    def raw_head_label(self) -> str:
        return "model.mtp_*.{N}."

    def missing_mtp_tensors(self, names: Iterable[str]) -> list[str]:
        relative = {r.removesuffix(".weight") for n in names if (r := self.head_relative(n))}
        layers = sorted({".".join(r.split(".")[:2]) for r in relative})
        return [
            f"{self.head_prefix}{layer}.{rel}"
            for layer in layers
            for rel in self.required_mtp_tensors
            if f"{layer}.{rel}".removesuffix(".weight") not in relative
        ]

    def rename_backbone(self, name: str) -> str | None:
        # mlx-lm's sanitize drops the router's score-correction bias (`moe_statics`).
        if "e_score_correction_bias" in name:
            return None
        return super().rename_backbone(name)
