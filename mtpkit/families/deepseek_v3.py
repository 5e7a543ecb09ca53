"""DeepSeek-V3/R1/V3.1 (`deepseek_v3`): the nextn layer follows the last decoder layer.

Its tensors sit at `model.layers.{num_hidden_layers + i}`: `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, a full decoder block, and copies of `embed_tokens` and `lm_head`
(`embed_tokens`, `shared_head.head`) that need not be pulled or kept.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from mtpkit.families.base import Family

NEXTN_REQUIRED = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
NEXTN_DUPLICATES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}


class NextnLayerFamily(Family):
    """Families whose MTP layers continue the decoder stack (DeepSeek-V3, GLM-4.5+)."""

    required_mtp_tensors = NEXTN_REQUIRED
    head_prefix = "mtp."

    @property
    def layer_pattern(self) -> re.Pattern[str]:
        return re.compile(r"^(?P<root>model\.layers\.(?P<layer>\d+)\.|mtp\.layers\.\d+\.)")

    def mtp_layer_prefix(self, name: str) -> str | None:
        m = self.layer_pattern.match(name)
        if m is None:
            return None
        if m["layer"] is not None and int(m["layer"]) < self.num_hidden_layers:
            return None
        return m["root"]

    def is_mtp_tensor(self, name: str) -> bool:
        return self.mtp_layer_prefix(name) is not None

    def duplicate_of(self, name: str) -> str | None:
        root = self.mtp_layer_prefix(name)
        if root is None:
            return None
        return NEXTN_DUPLICATES.get(name[len(root) :])

    def rename_head(self, name: str) -> str:
        m = self.layer_pattern.match(name)
        assert m is not None, name
        index = int(m["layer"]) - self.num_hidden_layers if m["layer"] is not None else None
        if index is None:  # already `mtp.layers.{i}.`
            return name
        return f"{self.head_prefix}layers.{index}.{name[m.end() :]}"

    def head_module(self, model: Any, layers: int) -> Any:
        import mlx.nn as nn

        from mtpkit.families.qwen3_5 import _rooted

        args = model.args
        hidden = args.hidden_size
        blocks = []
        for i in range(layers):
            # The nextn layer continues the stack, so mlx-lm's own rule (dense below
            # first_k_dense_replace, MoE above) picks its MLP from its true index.
            layer = self.decoder_layer_class()(args, self.num_hidden_layers + i)
            layer.enorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
            layer.hnorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
            layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head = nn.Module()
            layer.shared_head.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
            blocks.append(layer)
        head = nn.Module()
        head.layers = blocks
        return _rooted(head, self.head_prefix)

    def decoder_layer_class(self) -> Any:
        raise NotImplementedError


class DeepseekV3(NextnLayerFamily):
    name = "deepseek_v3"
    aliases: ClassVar[tuple[str, ...]] = ("kimi_k2",)

    def decoder_layer_class(self) -> Any:
        from mtpkit.quant import mlx_lm_models

        return mlx_lm_models("deepseek_v3").DeepseekV3DecoderLayer

    def split_tensor(self, name: str) -> list[tuple[str, Any]] | None:
        # mlx-lm's deepseek_v3 sanitize: MLA's kv_b_proj becomes the per-head embed_q
        # (transposed key part) and unembed_out (value part) that its attention multiplies by.
        if not name.endswith(".self_attn.kv_b_proj.weight"):
            return None
        import mlx.core as mx

        cfg = self.text_config
        nope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        heads = int(cfg["num_attention_heads"])
        prefix = name.removesuffix("kv_b_proj.weight")

        def embed_q(array: Any) -> Any:
            v = array.reshape(heads, nope + v_dim, -1)
            return mx.contiguous(v[:, :nope, :].swapaxes(-1, -2))

        def unembed_out(array: Any) -> Any:
            v = array.reshape(heads, nope + v_dim, -1)
            return mx.contiguous(v[:, nope:, :])

        return [(f"{prefix}embed_q.weight", embed_q), (f"{prefix}unembed_out.weight", unembed_out)]
