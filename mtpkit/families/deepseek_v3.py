"""DeepSeek-V3/R1/V3.1 (`deepseek_v3`, and what mlx-lm's MODEL_REMAPPING maps onto it).

The nextn layer follows the last decoder layer (see `mtpkit.families.nextn`); MLA's
`kv_b_proj` is split as mlx-lm's sanitize splits it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mtpkit.families.base import register
from mtpkit.families.head import MtpHead, NextnHead
from mtpkit.families.nextn import NextnFamily


class DeepseekNextnHead(NextnHead):
    # MLA attention takes an array mask, never the "causal" shortcut.
    mask_as_array = True


@register
class DeepseekV3(NextnFamily):
    name = "deepseek_v3"
    mlx_module = "deepseek_v3"
    block_class = "DeepseekV3DecoderLayer"
    head_class: ClassVar[type[MtpHead]] = DeepseekNextnHead

    def split_tensor(self, name: str) -> list[tuple[str, Any]] | None:
        # mlx-lm's deepseek_v3 sanitize: MLA's kv_b_proj becomes the per-head embed_q
        # (transposed key part) and unembed_out (value part) that its attention multiplies by.
        # LongCat keeps two attentions per layer (`self_attn.{0,1}.kv_b_proj`).
        if not name.endswith(".kv_b_proj.weight"):
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
