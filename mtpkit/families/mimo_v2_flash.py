"""MiMo-V2-Flash (`mimo_v2_flash`): a chain of MTP layers under `model.mtp.layers.{i}`.

Each layer keeps `enorm`, `hnorm`, `eh_proj` and `final_layernorm` beside a decoder block
(`input_layernorm`, `self_attn.*` with the attention sink `attention_sink_bias`,
`pre_mlp_layernorm`, a dense `mlp.*`); mlx-lm's `mimo_v2_flash` sanitize drops every
`model.mtp` key. The step, as vLLM's `mimo_v2_flash_mtp.py` and SGLang's
`mimo_v2_flash_nextn.py` run it: `final_layernorm(block(eh_proj(concat(enorm(embed),
hnorm(h)))))`, embedding first, then the shared lm_head. The block is always a
sliding-window attention layer (the `swa_*` head counts, dims and rope base, the SWA sink
bias) with the dense MLP (`intermediate_size`), which is mlx-lm's `DecoderLayer(args,
is_moe=False, is_sliding_window=True)`; `pre_mlp_layernorm` is its `post_attention_layernorm`.

The published checkpoint carries three layers and its config declares none (vLLM and
SGLang load one; the model card's multi-layer MTP chains them), so depth d drafts with
layer `d % num_layers`. Norms are plain.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.head import MtpHead

# The checkpoint's name for the block's second norm -> mlx-lm's.
RAW_POST_NORM = ".pre_mlp_layernorm."
POST_NORM = ".post_attention_layernorm."


def mimo_v2_layer_class(block: type[nn.Module]) -> type[nn.Module]:
    """mlx-lm's MiMo-V2 decoder layer (sliding window, dense MLP) with the nextn parts."""

    class MimoV2MtpLayer(block):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any) -> None:
            super().__init__(args, is_moe=False, is_sliding_window=True)
            h, eps = args.hidden_size, args.layernorm_epsilon
            self.enorm = nn.RMSNorm(h, eps=eps)
            self.hnorm = nn.RMSNorm(h, eps=eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.final_layernorm = nn.RMSNorm(h, eps=eps)

    return MimoV2MtpLayer


class MimoV2Head(MtpHead):
    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "enorm",
        "norm_hidden": "hnorm",
        "projection": "eh_proj",
        "final_norm": "final_layernorm",
    }

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        layer_cls = mimo_v2_layer_class(block)
        self.layers = [layer_cls(args) for _ in range(num_layers)]
        self._window = args.sliding_window_size

    def window_size(self, i: int) -> int | None:
        return self._window


@register
class MimoV2Flash(Family):
    name = "mimo_v2_flash"
    declared_upstream = False
    raw_head_roots: ClassVar[tuple[str, ...]] = ("model.mtp.", "mtp.")
    required_mtp_tensors = (
        "layers.0.enorm.weight",
        "layers.0.hnorm.weight",
        "layers.0.eh_proj.weight",
        "layers.0.final_layernorm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
    )
    head_class: ClassVar[type[MtpHead]] = MimoV2Head
    mlx_module = "mimo_v2_flash"
    block_class = "DecoderLayer"

    @property
    def num_experts(self) -> int:
        return int(self.text_config.get("n_routed_experts") or 0)

    def head_relative(self, name: str) -> str | None:
        relative = super().head_relative(name)
        return None if relative is None else relative.replace(RAW_POST_NORM, POST_NORM)
