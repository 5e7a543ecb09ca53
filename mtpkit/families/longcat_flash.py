"""LongCat-Flash (`longcat_flash`): one MTP layer under `model.mtp.`, a dense MLA block.

vLLM (`longcat_flash_mtp.py`) reads `model.mtp.layers.0.{enorm.m,hnorm.m,eh_proj}`, an MLA
attention and a dense MLP (`transformer_layer.mlp.*`, no MoE), and `model.mtp.norm` as the
final norm; `model.mtp.embed_tokens` repeats the backbone's embedding, which the head uses.
The config declares no MTP field (vLLM always builds one layer). The step is DeepSeek's:
`eh_proj(concat(enorm(embed), hnorm(h)))`, then the block, then `norm` and the shared lm_head.
The block is built from mlx-lm's `LongcatFlashMLA` (with its q/kv LoRA scales) and
`LongcatFlashMLP`; names mirror the checkpoint's, so only the MLA `kv_b_proj` split renames.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.deepseek_v3 import DeepseekV3
from mtpkit.families.head import MtpHead
from mtpkit.mlxlm import mlx_lm_models


class Wrapped(nn.Module):
    """A norm kept at `<name>.m` as the checkpoint keeps it."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.m = module


class TransformerLayer(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp


def longcat_mtp_layer_class(attention: type[nn.Module], mlp: type[nn.Module]) -> type[nn.Module]:
    """The MTP layer: mlx-lm's LongCat MLA and dense MLP, pre-norm residual, plus the nextn
    projection and norms."""

    class LongcatMtpLayer(nn.Module):
        def __init__(self, args: Any) -> None:
            super().__init__()
            h, eps = args.hidden_size, args.rms_norm_eps
            self.enorm = Wrapped(nn.RMSNorm(h, eps=eps))
            self.hnorm = Wrapped(nn.RMSNorm(h, eps=eps))
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.input_layernorm = nn.RMSNorm(h, eps=eps)
            self.self_attn = attention(args)
            self.post_attention_layernorm = nn.RMSNorm(h, eps=eps)
            self.transformer_layer = TransformerLayer(mlp(args, False))

        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
            return h + self.transformer_layer.mlp(self.post_attention_layernorm(h))

    return LongcatMtpLayer


class LongcatHead(MtpHead):
    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "enorm.m",
        "norm_hidden": "hnorm.m",
        "projection": "eh_proj",
    }
    mask_as_array = True

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        self.layers = [block(args) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def final_norm(self, i: int) -> nn.Module:
        # One final norm for the head (`model.mtp.norm`), whatever the layer.
        return self.norm


@register
class LongcatFlash(Family):
    name = "longcat_flash"
    config_field = "num_nextn_predict_layers"
    declared_upstream = False
    raw_head_roots: ClassVar[tuple[str, ...]] = ("model.mtp.", "mtp.")
    duplicates: ClassVar[dict[str, str]] = {"embed_tokens.weight": "model.embed_tokens.weight"}
    head_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)
    required_mtp_tensors = (
        "layers.0.enorm.m.weight",
        "layers.0.hnorm.m.weight",
        "layers.0.eh_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
        "norm.weight",
    )
    head_class: ClassVar[type[MtpHead]] = LongcatHead
    mlx_module = "longcat_flash"
    block_class = "LongcatFlashMLA"
    split_tensor = DeepseekV3.split_tensor

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_layers"])

    def head_block(self) -> type[Any]:
        module = mlx_lm_models(self.mlx_module)
        return longcat_mtp_layer_class(module.LongcatFlashMLA, module.LongcatFlashMLP)
