"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3's nextn layer with DSA sparse attention.

The nextn layer sits at `model.layers.{num_hidden_layers}` with DeepSeek-V3's names; its
attention carries the DSA indexer (`self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`), as
the backbone's does, and keeps two caches per layer (MLA latents, indexer keys), so the head
does too. vLLM runs the same layer for V3.2 (`deepseek_mtp.py`, `is_v32` from `index_topk`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from mtpkit.families.base import register
from mtpkit.families.deepseek_v3 import DeepseekNextnHead, DeepseekV3
from mtpkit.families.head import MtpHead


class DsaNextnHead(DeepseekNextnHead):
    """Nextn layers whose attention is DeepSeek Sparse Attention: each layer's cache is
    mlx-lm's pair (MLA cache, indexer cache), and the mask follows the MLA one."""

    def mask_cache(self, layer_cache: Any) -> Any:
        return None if layer_cache is None else layer_cache[0]

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import CacheList, KVCache

        return [CacheList(KVCache(), KVCache()) for _ in self.layers]


@register
class DeepseekV32(DeepseekV3):
    name = "deepseek_v32"
    mlx_module = "deepseek_v32"
    block_class = "DeepseekV32DecoderLayer"
    head_class: ClassVar[type[MtpHead]] = DsaNextnHead
