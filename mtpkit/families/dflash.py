"""DFlash (z-lab/dflash, arXiv 2602.06036): a block drafter conditioned on its target's
hidden states, proposing a whole block in one parallel pass.

The published layout (z-lab's `DFlashDraftModel`, config `architectures:
["DFlashDraftModel"]`, Qwen3-style fields):

    context = hidden_norm(fc(concat(h_l for l in target_layer_ids)))      # [S, H]
    x = target_embed([last, mask, mask, ...])                              # [L, H]
    each of `num_hidden_layers` Qwen3 decoder layers: q from x; k, v from
        concat(context, x), both k's through k_norm; no causal mask over the block
    logits = target_lm_head(norm(x))[1:]                                   # L-1 drafts

`h_l` is the output of target decoder layer `l` (transformers' `hidden_states[l + 1]`).
The drafter has no embedding or output head: the target's are shared. The context's K/V
of confirmed positions are kept in the drafter's own cache; the block's are never kept.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError
from mtpkit.mlxlm import cache_keys_values

ARCHITECTURE = "DFlashDraftModel"
# Tensors shared with the target that some exports carry anyway (never loaded).
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")
LAYER_TENSORS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
TOP_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")


def is_dflash(config: Any) -> bool:
    """Whether a config.json is a DFlash drafter's (its architecture or its `dflash_config`)."""
    if not isinstance(config, dict):
        return False
    return ARCHITECTURE in (config.get("architectures") or []) or "dflash_config" in config


def default_target_layers(target_layers: int, draft_layers: int) -> list[int]:
    """z-lab's `build_target_layer_ids`: evenly spread over layers 1 .. N-3 (one draft
    layer: the middle one), for a config that names no `target_layer_ids`."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    return [round(start + i * (end - start) / (draft_layers - 1)) for i in range(draft_layers)]


def tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in `DFlashModel` (None: shared with the target)."""
    name = name.removeprefix("model.")
    return None if name in SHARED_WITH_TARGET else name


@dataclass(frozen=True)
class DFlashLayout:
    """What a DFlash config.json says (see the module's text)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int | None
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def of(cls, config: dict[str, Any], where: str = "the drafter") -> DFlashLayout:
        dflash = config.get("dflash_config") or {}
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            layers = int(config["num_hidden_layers"])
            target_layers = int(config["num_target_layers"])
            ids = dflash.get("target_layer_ids") or default_target_layers(target_layers, layers)
            mask = dflash.get("mask_token_id")
            return cls(
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads", heads)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(config.get("rope_theta", 1e6)),
                max_position_embeddings=int(config.get("max_position_embeddings", 40960)),
                block_size=int(config.get("block_size", dflash.get("block_size", 16))),
                num_target_layers=target_layers,
                target_layer_ids=tuple(int(i) for i in ids),
                mask_token_id=None if mask is None else int(mask),
                attention_bias=bool(config.get("attention_bias", False)),
                rope_scaling=config.get("rope_scaling"),
            )
        except KeyError as e:
            raise MtpkitError(
                f"{where}'s config.json lacks {e.args[0]!r}, which a DFlash drafter's config "
                "has: pass the drafter's directory as published"
            ) from None
        except (TypeError, ValueError) as e:
            raise MtpkitError(f"{where}'s config.json has a value DFlash cannot use ({e})") from None

    @property
    def max_drafts(self) -> int:
        """Drafts of one block: its first position is the last confirmed token."""
        return self.block_size - 1

    def tensor_names(self) -> list[str]:
        """Every tensor the drafter has, in `DFlashModel`'s names."""
        layers = [
            f"layers.{i}.{t}" for i in range(self.num_hidden_layers) for t in LAYER_TENSORS
        ]
        return [*TOP_TENSORS, *layers]

    def intrinsic_problems(self) -> list[str]:
        """What is wrong with the config on its own."""
        problems = []
        if self.mask_token_id is None:
            problems.append("dflash_config names no mask_token_id")
        elif not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(
                f"mask_token_id {self.mask_token_id} is outside its vocabulary of {self.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            problems.append(
                f"target_layer_ids {bad} are outside the {self.num_target_layers} target layers"
            )
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} drafts nothing (it needs 2 or more)")
        return problems

    def target_problems(self, target: dict[str, Any]) -> list[str]:
        """Why this drafter cannot draft for a target of config `target` (text config)."""
        problems = []
        layers = target.get("num_hidden_layers")
        if layers is not None and int(layers) != self.num_target_layers:
            problems.append(
                f"it reads a target of {self.num_target_layers} layers, and this one has {layers}"
            )
        hidden = target.get("hidden_size")
        if hidden is not None and int(hidden) != self.hidden_size:
            problems.append(
                f"its hidden size {self.hidden_size} is not the target's {hidden} (it shares "
                "the target's embedding)"
            )
        vocab = target.get("vocab_size")
        if vocab is not None and int(vocab) != self.vocab_size:
            problems.append(f"a vocabulary of {self.vocab_size} against the target's {vocab}")
        return problems


def tensor_problem(layout: DFlashLayout, names: Iterable[str]) -> str | None:
    """The first tensor the layout needs and `names` lack, or has and the layout does not."""
    present = {n.removesuffix(".weight") for n in names if n.endswith(".weight")}
    present |= {n.rsplit(".", 1)[0] for n in names if n.endswith((".scales", ".biases"))}
    expected = {n.removesuffix(".weight") for n in layout.tensor_names()}
    missing = sorted(expected - present)
    if missing:
        return f"it lacks {missing[0]}.weight ({len(missing)} tensor(s) missing)"
    unknown = sorted(present - expected)
    if unknown:
        return f"it has {unknown[0]}, which a DFlash drafter of this config has not"
    return None


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from the context and the block, no mask."""

    def __init__(self, layout: DFlashLayout) -> None:
        super().__init__()
        d, h, kv = layout.head_dim, layout.num_attention_heads, layout.num_key_value_heads
        bias = layout.attention_bias
        self.heads, self.kv_heads, self.scale = h, kv, d**-0.5
        self.q_proj = nn.Linear(layout.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(layout.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(layout.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, layout.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=layout.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=layout.rms_norm_eps)

    def kv(self, x: mx.array, rope: Any, offset: int) -> tuple[mx.array, mx.array]:
        """Keys (normed, rotated from `offset`) and values of `x` [B, N, H]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=offset), v

    def __call__(self, x: mx.array, context: mx.array | None, rope: Any, cache: Any) -> mx.array:
        b, n, _ = x.shape
        new = 0 if context is None else context.shape[1]
        start = cache.offset + new  # the block's first position
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=start)
        k, v = self.kv(x, rope, start)
        if new:  # confirmed positions: kept in the cache; the block's never are
            keys, values = cache.update_and_fetch(*self.kv(context, rope, cache.offset))
        elif cache.offset:
            keys, values = cache_keys_values(cache)
        else:
            keys = values = None
        if keys is not None:
            k, v = mx.concatenate([keys, k], axis=2), mx.concatenate([values, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, layout: DFlashLayout) -> None:
        super().__init__()
        from mlx_lm.models.qwen3 import MLP

        self.self_attn = DFlashAttention(layout)
        self.mlp = MLP(layout.hidden_size, layout.intermediate_size)
        self.input_layernorm = nn.RMSNorm(layout.hidden_size, eps=layout.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(layout.hidden_size, eps=layout.rms_norm_eps)

    def __call__(self, x: mx.array, context: mx.array | None, rope: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), context, rope, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's own weights (see the module's text); the target embeds and scores."""

    def __init__(self, layout: DFlashLayout) -> None:
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        self.layout = layout
        width = len(layout.target_layer_ids) * layout.hidden_size
        self.fc = nn.Linear(width, layout.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(layout.hidden_size, eps=layout.rms_norm_eps)
        self.layers = [DFlashLayer(layout) for _ in range(layout.num_hidden_layers)]
        self.norm = nn.RMSNorm(layout.hidden_size, eps=layout.rms_norm_eps)
        self.rope = initialize_rope(
            layout.head_dim,
            base=layout.rope_theta,
            traditional=False,
            scaling_config=layout.rope_scaling,
            max_position_embeddings=layout.max_position_embeddings,
        )

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def add_context(self, features: mx.array, cache: list[Any]) -> None:
        """Put the K/V of target `features` [1, S, n*H] (the next confirmed positions) into
        `cache`, with no block (a prompt's chunk: its features need not be kept)."""
        context = self.hidden_norm(self.fc(features))
        for layer, c in zip(self.layers, cache, strict=True):
            attn = layer.self_attn
            c.update_and_fetch(*attn.kv(context, self.rope, c.offset))

    def __call__(self, block: mx.array, features: mx.array | None, cache: list[Any]) -> mx.array:
        """Final-normed hidden states [1, L, H] of the embedded `block` [1, L, H], after the
        target `features` [1, S, n*H] of the positions not yet in `cache` (None: none)."""
        context = None if features is None else self.hidden_norm(self.fc(features))
        x = block
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, context, self.rope, c)
        return self.norm(x)
