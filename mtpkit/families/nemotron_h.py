"""Nemotron-H (`nemotron_h`, Nemotron 3): an MTP layer made of several blocks, under `mtp.`.

One MTP layer (step) is a short stack of Nemotron-H blocks whose kinds the config spells as
`mtp_hybrid_override_pattern` (`"*E"`: attention, then MoE; transformers 5 writes
`mtp_layers_block_type`). The checkpoint numbers the blocks flat: `mtp.layers.{j}` with
`j = step * len(pattern) + position`; the first block of a step carries `enorm`, `hnorm`
and `eh_proj`, the last `final_layernorm` (mlx-lm's `nemotron_h` sanitize drops every
`mtp.` key). The step, as vLLM's `nemotron_h_mtp.py` runs it:
`final_layernorm(blocks(eh_proj(concat(enorm(embed), hnorm(h)))))`, embedding first, each
block the pre-norm residual `x + mixer(norm(x))` of mlx-lm's own `NemotronHBlock` (NoPE
attention with its own KV cache; the MoE with ReLU^2 experts, the router's correction bias,
the latent projections of Nemotron 3 Super), then the shared lm_head. Norms are plain.
Per-expert `experts.{e}.{up,down}_proj` stack into mlx-lm's `switch_mlp.{fc1,fc2}`.
The backbone's Mamba-2 state cannot be trimmed: a rejected draft is rolled back by replay
(`mtpkit.runtime.rollback.replay`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError
from mtpkit.families.base import Family, register
from mtpkit.families.head import EMBEDDING_FIRST, MtpHead

# transformers' block names -> mlx-lm's pattern characters (`nemotron_h.ModelArgs`).
BLOCK_CHARS = {"full_attention": "*", "attention": "*", "moe": "E", "mlp": "-"}
DEFAULT_PATTERN = "*E"  # transformers' default `mtp_layers_block_type`


def mtp_pattern(config: dict[str, Any]) -> str:
    """The block kinds of one MTP layer, as mlx-lm's pattern characters."""
    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None and config.get("mtp_layers_block_type"):
        pattern = "".join(BLOCK_CHARS.get(t, "?") for t in config["mtp_layers_block_type"])
    pattern = "".join(pattern or DEFAULT_PATTERN)
    if set(pattern) - {"*", "E", "-"}:
        raise MtpkitError(
            f"Nemotron-H MTP pattern {pattern!r}: only attention (*), MoE (E) and MLP (-) "
            "blocks are supported (as in vLLM)"
        )
    return pattern


def nemotron_mtp_block_class(block: type[nn.Module]) -> type[nn.Module]:
    """mlx-lm's NemotronHBlock with the step's projection and norms where the checkpoint
    keeps them: on the first block of a step, and the final norm on its last."""

    class NemotronHMtpBlock(block):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, block_type: str, first: bool, last: bool) -> None:
            super().__init__(args, block_type)
            h, eps = args.hidden_size, args.layer_norm_epsilon
            if first:
                self.enorm = nn.RMSNorm(h, eps=eps)
                self.hnorm = nn.RMSNorm(h, eps=eps)
                self.eh_proj = nn.Linear(2 * h, h, bias=False)
            if last:
                self.final_layernorm = nn.RMSNorm(h, eps=eps)

    return NemotronHMtpBlock


class NemotronHHead(MtpHead):
    """`layers` holds every block, flat as the checkpoint numbers them; MTP layer (step) i
    is blocks `i * len(pattern)` to `(i + 1) * len(pattern) - 1`. Its cache is one
    `CacheList` of KV caches, one per attention block."""

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        self._pattern = args.mtp_pattern
        size = len(self._pattern)
        block_cls = nemotron_mtp_block_class(block)
        self.layers = [
            block_cls(args, kind, j == 0, j == size - 1)
            for _ in range(num_layers)
            for j, kind in enumerate(self._pattern)
        ]

    @classmethod
    def build(
        cls, args: Any, block: type[nn.Module], num_layers: int, names: Iterable[str] = ()
    ) -> MtpHead:
        # Callers count `layers.{i}` groups, which are blocks here.
        return cls(args, block, max(1, math.ceil(num_layers / len(args.mtp_pattern))))

    @property
    def num_steps(self) -> int:
        return len(self.layers) // len(self._pattern)

    def blocks(self, i: int) -> list[nn.Module]:
        size = len(self._pattern)
        return self.layers[i * size : (i + 1) * size]

    def norm_embedding(self, i: int) -> nn.Module:
        return self.blocks(i)[0].enorm

    def norm_hidden(self, i: int) -> nn.Module:
        return self.blocks(i)[0].hnorm

    def projection(self, i: int) -> nn.Module:
        return self.blocks(i)[0].eh_proj

    def final_norm(self, i: int) -> nn.Module:
        return self.blocks(i)[-1].final_layernorm

    def layer_for_step(self, step: int) -> int:
        return step % self.num_steps

    def __call__(
        self,
        hidden: mx.array,
        embedded: mx.array,
        cache: list[Any] | None = None,
        step: int = 0,
    ) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        i = self.layer_for_step(step)
        e = self.norm_embedding(i)(embedded)
        h = self.norm_hidden(i)(hidden)
        parts = [e, h] if self.concat_order == EMBEDDING_FIRST else [h, e]
        x = self.projection(i)(mx.concatenate(parts, axis=-1))
        caches = list(cache[i].caches) if cache is not None else []
        mask = create_attention_mask(x, caches[0] if caches else None)
        for block in self.blocks(i):
            attends = block.block_type == "*"
            block_cache = caches.pop(0) if attends and caches else None
            x = block(x, mask=mask if attends else None, cache=block_cache)
        return x

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import CacheList, KVCache

        attention = self._pattern.count("*")
        return [CacheList(*(KVCache() for _ in range(attention))) for _ in range(self.num_steps)]


@register
class NemotronH(Family):
    name = "nemotron_h"
    raw_head_roots: ClassVar[tuple[str, ...]] = ("mtp.",)
    required_mtp_tensors = (
        "layers.0.enorm.weight",
        "layers.0.hnorm.weight",
        "layers.0.eh_proj.weight",
        "layers.0.norm.weight",
    )
    has_conv1d = True
    expert_projections: ClassVar[dict[str, str]] = {"up_proj": "fc1", "down_proj": "fc2"}
    head_class: ClassVar[type[MtpHead]] = NemotronHHead
    mlx_module = "nemotron_h"
    block_class = "NemotronHBlock"
    decoder_attr = "backbone"
    embedding_attr = "embeddings"
    final_norm_attr = "norm_f"

    def head_args(self, model: Any = None) -> Any:
        # mlx-lm's ModelArgs has no MTP pattern: carry it on a copy of the args.
        args = dataclasses.replace(super().head_args(model))
        args.mtp_pattern = mtp_pattern(self.text_config)
        return args

    def config_mtp_layers(self, head_layers: int) -> int:
        return math.ceil(head_layers / len(mtp_pattern(self.text_config)))
