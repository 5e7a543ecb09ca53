"""EAGLE-3 (SafeAILab/EAGLE, arXiv 2503.01840): a one-layer drafter over a fusion of three of
its target's hidden states, chained autoregressively with its own KV cache.

The published layout (config `architectures: ["LlamaForCausalLMEagle3"]`, Llama fields,
`draft_vocab_size`; vLLM's `llama_eagle3.py`, SGLang's, the EAGLE repo's `cnets.py`):

    fused = fc(concat(g_a, g_b, g_c))              # [T, H]: g_j is the input of target layer j
    x = concat(input_layernorm(embed(t_{p+1})), hidden_norm(h_p))   # [T, 2H]: q/k/v read 2H
    h = residual + attn(x) (causal, RoPE at the pair's index p); h = h + mlp(post_norm(h))
    draft = d2t-mapped argmax of lm_head(norm(h))  # over the draft vocabulary

`h_p` is the fused target state of position p for a confirmed pair (its next token
t_{p+1}), and the drafter's own `h` of the position before for a draft step. `residual` is
`h_p` (`hidden_norm(h_p)` with `norm_before_residual`). The target layers default to
(2, N // 2, N - 3) (EAGLE's `all_hidden_states`, vLLM's `get_eagle3_aux_hidden_state_layers`),
else the config's `eagle_aux_hidden_state_layer_ids`. `d2t[i]` is the offset of draft id i:
its target id is `i + d2t[i]`; `t2d` (a mask over the target's vocabulary) is not needed.
The embedding is the target's (SGLang's `set_embed`); an exported copy is left out unless
the drafter's width differs from its target's, where only its own can be used.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# vLLM speculators' extra norms (`norm_before_fc`, ...): a layout mtpkit does not build.
UNBUILT_NORMS = ("norm_before_fc", "fc_norm", "norm_output")
LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
TOP_TENSORS = ("fc.weight", "norm.weight", "lm_head.weight")
VOCAB_MAPS = ("d2t", "t2d")  # int64 offsets [draft vocab], bool mask [vocab]: not weights
EMBEDDING = "embed_tokens.weight"


def is_eagle3(config: Any) -> bool:
    """Whether a config.json is an EAGLE-3 drafter's (its architecture or `draft_vocab_size`)."""
    if not isinstance(config, dict):
        return False
    return (
        bool(set(config.get("architectures") or []) & set(ARCHITECTURES))
        or "draft_vocab_size" in config
        or config.get("speculators_model_type") == "eagle3"
    )


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """One level of fields: vLLM's speculators export nests the layer's Llama fields in
    `transformer_layer_config` beside EAGLE-3's own, and there `norm_before_residual`
    defaults to true (vLLM's `update_eagle3`)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return config
    return {**layer, "norm_before_residual": True, **{k: v for k, v in config.items()
                                                       if k != "transformer_layer_config"}}  # fmt: skip


def default_target_layers(target_layers: int) -> tuple[int, int, int]:
    """EAGLE's low/mid/high layers of an N-layer target: the inputs of 2, N // 2, N - 3."""
    return 2, target_layers // 2, target_layers - 3


def tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in `Eagle3Model` (`midlayer.*`; vLLM's speculators export
    names it `layers.0.*`), or the vocabulary maps' own; None: `t2d`, which nothing reads."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return None if name == "t2d" else name


@dataclass(frozen=True)
class Eagle3Layout:
    """What an EAGLE-3 config.json says (see the module's text)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_layer_ids: tuple[int, ...] | None  # None: the default of the target's depth
    norm_before_residual: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: dict[str, Any] | None = None
    unbuilt_norms: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: dict[str, Any], where: str = "the drafter") -> Eagle3Layout:
        config = flat_config(config)
        eagle = config.get("eagle_config") or {}
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            vocab = int(config["vocab_size"])
            ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
                "eagle_aux_hidden_state_layer_ids"
            )
            return cls(
                hidden_size=hidden,
                num_hidden_layers=int(config.get("num_hidden_layers", 1)),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=vocab,
                draft_vocab_size=int(config.get("draft_vocab_size") or vocab),
                target_hidden_size=int(config.get("target_hidden_size") or hidden),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
                target_layer_ids=None if not ids else tuple(int(i) for i in ids),
                norm_before_residual=bool(config.get("norm_before_residual", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                hidden_act=str(config.get("hidden_act", "silu")),
                rope_scaling=config.get("rope_scaling"),
                unbuilt_norms=tuple(k for k in UNBUILT_NORMS if config.get(k)),
            )
        except KeyError as e:
            raise MtpkitError(
                f"{where}'s config.json lacks {e.args[0]!r}, which an EAGLE-3 drafter's config "
                "has: pass the drafter's directory as published"
            ) from None
        except (TypeError, ValueError) as e:
            raise MtpkitError(f"{where}'s config.json has a value EAGLE-3 cannot use ({e})") from None

    @property
    def own_embedding(self) -> bool:
        """Whether it embeds with its own table: only when its width is not its target's."""
        return self.hidden_size != self.target_hidden_size

    @property
    def maps_vocabulary(self) -> bool:
        """Whether it drafts over a subset of the target's vocabulary (a `d2t` map)."""
        return self.draft_vocab_size != self.vocab_size

    def layer_ids(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs it reads, for a target of `target_layers` layers."""
        if self.target_layer_ids is not None:
            return self.target_layer_ids
        return default_target_layers(target_layers)

    def tensor_names(self) -> list[str]:
        """Every tensor the drafter has, in `Eagle3Model`'s names (`d2t` included)."""
        names = [*TOP_TENSORS, *(f"midlayer.{t}" for t in LAYER_TENSORS)]
        names += [EMBEDDING] if self.own_embedding else []
        return names + (["d2t"] if self.maps_vocabulary else [])

    def shared(self, name: str) -> bool:
        """A tensor of the checkpoint that is its target's (an exported embedding copy)."""
        return name == EMBEDDING and not self.own_embedding

    def intrinsic_problems(self) -> list[str]:
        """What is wrong with the config on its own."""
        problems = []
        if self.num_hidden_layers != 1:
            problems.append(
                f"it has {self.num_hidden_layers} decoder layers; mtpkit runs the one-layer "
                "EAGLE-3 drafters that are published"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(
                f"draft_vocab_size {self.draft_vocab_size} is not within its target "
                f"vocabulary of {self.vocab_size}"
            )
        ids = self.target_layer_ids
        if ids is not None and len(ids) != 3:
            problems.append(f"it names {len(ids)} target layers; its fc fuses 3")
        if ids is not None and min(ids) < 1:
            problems.append(
                "it reads the input of target layer 0 (the embeddings), which mtpkit does not tap"
            )
        if self.unbuilt_norms:
            problems.append(f"{self.unbuilt_norms[0]} is set: a norm mtpkit's EAGLE-3 layer has not")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act {self.hidden_act!r} (EAGLE-3's layer is Llama's, silu)")
        return problems

    def target_problems(self, target: dict[str, Any]) -> list[str]:
        """Why this drafter cannot draft for a target of config `target` (text config)."""
        problems = []
        hidden = target.get("hidden_size")
        if hidden is not None and int(hidden) != self.target_hidden_size:
            problems.append(
                f"it fuses hidden states of width {self.target_hidden_size}, and this target's "
                f"are {hidden} wide"
            )
        vocab = target.get("vocab_size")
        if vocab is not None and int(vocab) != self.vocab_size:
            problems.append(f"a vocabulary of {self.vocab_size} against the target's {vocab}")
        layers = target.get("num_hidden_layers")
        if layers is not None:
            bad = [i for i in self.layer_ids(int(layers)) if not 1 <= i <= int(layers)]
            if bad:
                problems.append(f"it reads target layers {bad}, and this one has {layers}")
        return problems


def tensor_problem(layout: Eagle3Layout, names: Iterable[str]) -> str | None:
    """The first tensor the layout needs and `names` lack, or has and the layout does not."""
    names = [n for n in names if not layout.shared(n)]
    present = {n.removesuffix(".weight") for n in names if n.endswith(".weight") or n == "d2t"}
    present |= {n.rsplit(".", 1)[0] for n in names if n.endswith((".scales", ".biases"))}
    expected = {n.removesuffix(".weight") for n in layout.tensor_names()}
    missing = sorted(expected - present)
    if missing:
        suffix = "" if missing[0] == "d2t" else ".weight"
        return f"it lacks {missing[0]}{suffix} ({len(missing)} tensor(s) missing)"
    unknown = sorted(present - expected - {"d2t"})
    if unknown:
        return f"it has {unknown[0]}, which an EAGLE-3 drafter of this config has not"
    return None


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embedding; hidden] input, causal."""

    def __init__(self, layout: Eagle3Layout) -> None:
        super().__init__()
        from mlx_lm.models.rope_utils import initialize_rope

        d, h, kv = layout.head_dim, layout.num_attention_heads, layout.num_key_value_heads
        bias, width = layout.attention_bias, 2 * layout.hidden_size
        self.heads, self.kv_heads, self.scale = h, kv, d**-0.5
        self.q_proj = nn.Linear(width, h * d, bias=bias)
        self.k_proj = nn.Linear(width, kv * d, bias=bias)
        self.v_proj = nn.Linear(width, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, layout.hidden_size, bias=bias)
        self.rope = initialize_rope(
            d,
            base=layout.rope_theta,
            traditional=False,
            scaling_config=layout.rope_scaling,
            max_position_embeddings=layout.max_position_embeddings,
        )

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        from mlx_lm.models.base import create_attention_mask

        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        # Causal, aligned to the cache's end (the pairs' order); a batch's rows' left
        # padding masked too (read before the update moves the write index).
        mask = create_attention_mask(x, cache)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class Eagle3Layer(nn.Module):
    """EAGLE's `midlayer` (`LlamaDecoderLayeremb`)."""

    def __init__(self, layout: Eagle3Layout) -> None:
        super().__init__()
        from mlx_lm.models.qwen3 import MLP

        eps = layout.rms_norm_eps
        self.norm_before_residual = layout.norm_before_residual
        self.self_attn = Eagle3Attention(layout)
        self.mlp = MLP(layout.hidden_size, layout.intermediate_size)
        self.input_layernorm = nn.RMSNorm(layout.hidden_size, eps=eps)
        self.hidden_norm = nn.RMSNorm(layout.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(layout.hidden_size, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: Any) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + self.self_attn(x, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Model(nn.Module):
    """The drafter's weights (see the module's text); `d2t` is kept beside it, not in it."""

    def __init__(self, layout: Eagle3Layout) -> None:
        super().__init__()
        self.layout = layout
        self.fc = nn.Linear(3 * layout.target_hidden_size, layout.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(layout)
        self.norm = nn.RMSNorm(layout.hidden_size, eps=layout.rms_norm_eps)
        self.lm_head = nn.Linear(layout.hidden_size, layout.draft_vocab_size, bias=False)
        if layout.own_embedding:
            self.embed_tokens = nn.Embedding(layout.vocab_size, layout.hidden_size)

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def fuse(self, features: mx.array) -> mx.array:
        """The fused state [..., H] of target states `features` [..., 3H_t]."""
        return self.fc(features)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[Any]) -> mx.array:
        """The layer's output [B, T, H] (before the final norm: the next step's hidden) at
        pairs of `embeds` [B, T, H] and `hidden` [B, T, H] (fused target states, or its own
        output of the position before), appended to `cache`."""
        return self.midlayer(embeds, hidden, cache[0])

    def draft_logits(self, h: mx.array) -> mx.array:
        """Logits over the draft vocabulary [..., V_d] of layer outputs `h` [..., H]."""
        return self.lm_head(self.norm(h))
