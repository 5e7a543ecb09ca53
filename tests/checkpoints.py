"""Tiny checkpoints in the real published on-disk formats, for tests.

Every layout is written the way its family is published: real key names, real config fields,
sharded safetensors with a `model.safetensors.index.json`, a real tokenizer. Only the sizes are
tiny (hidden 64, 2-4 layers, 4 experts). Stock mlx-lm loads each raw layout's backbone, which
`tests/test_checkpoints.py` proves, so a fixture that drifts from the real format fails there
rather than silently in the tests that use it.

Weights are drawn from an RNG keyed on (seed, tensor name), never on draw order, so a
checkpoint built with `with_mtp=False` has the same backbone, bit for bit, as its MTP twin.

Formats: /work/shared/docs/MTP_FORMATS.md; key names and shapes follow mlx-lm 0.32's
`models/{qwen3_5,qwen3_5_moe,qwen3_next,deepseek_v3,glm4_moe,mimo}.py`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "FAMILIES",
    "MLX_LAYOUTS",
    "RAW_LAYOUTS",
    "TOKENIZER_SPECIAL_TOKENS",
    "build_checkpoint",
    "write_tokenizer",
]

# Layouts written in the raw Hugging Face format (what a Hub repo holds).
RAW_LAYOUTS: tuple[str, ...] = (
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_6_moe",
    "qwen3_next",
    "deepseek_v3",
    "glm4_moe",
    "mimo",
    "stripped",
)
# Layouts written by mlx-lm (what an `mlx-community/...` repo holds).
MLX_LAYOUTS: tuple[str, ...] = ("mlx_inline", "mlx_plain")
FAMILIES: tuple[str, ...] = RAW_LAYOUTS + MLX_LAYOUTS

# Special tokens, in id order 0, 1, 2 of the fixture tokenizer.
TOKENIZER_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_ENDOFTEXT_ID, _IM_START_ID, _IM_END_ID = 0, 1, 2

_DTYPES = ("bfloat16", "float16", "float32")
_HIDDEN = 64
# Spread of random matrices and of the random part of norm weights (HF initializer_range is
# 0.02). Embeddings and lm_head are a little wider, giving logits of std ~0.4.
_MATRIX_STD = 0.04
_EMBED_STD = 0.05
_NORM_STD = 0.05
# Quantization of the MLX layouts, as published "-4bit" builds and mlx-lm's qwen3_5 predicate do.
_Q_GROUP_SIZE = 64
_Q_BITS = 4
_ROUTER_BITS = 8


# --------------------------------------------------------------------------- tensors


@dataclass
class _Tensors:
    """Float32 tensors in file order, each drawn from an RNG keyed on (seed, name)."""

    seed: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # Tensors the real checkpoints keep in float32 whatever the model dtype
    # (transformers' `_keep_in_fp32_modules_strict`, e.g. DeepSeek's e_score_correction_bias).
    float32_names: set[str] = field(default_factory=set)

    def _rng(self, name: str) -> np.random.Generator:
        digest = hashlib.sha256(name.encode()).digest()
        return np.random.default_rng([self.seed, int.from_bytes(digest[:8], "little")])

    def put(self, name: str, array: np.ndarray, *, keep_float32: bool = False) -> None:
        if name in self.arrays:
            raise ValueError(f"fixture builder wrote {name} twice")
        self.arrays[name] = np.ascontiguousarray(array, dtype=np.float32)
        if keep_float32:
            self.float32_names.add(name)

    def normal(self, name: str, shape: tuple[int, ...], *, std: float, mean: float = 0.0) -> None:
        self.put(name, self._rng(name).normal(mean, std, size=shape))

    def matrix(self, name: str, *shape: int, std: float = _MATRIX_STD) -> None:
        self.normal(name, shape, std=std)

    def norm(self, name: str, size: int, *, zero_centred: bool) -> None:
        # Zero-centred norms (Qwen3.5/3.6/Next) are applied as (1 + w): real ones sit near 0.
        self.normal(name, (size,), std=_NORM_STD, mean=0.0 if zero_centred else 1.0)

    def uniform(self, name: str, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
        return self._rng(name).uniform(low, high, size=shape)

    def to_mlx(self, dtype: mx.Dtype) -> dict[str, mx.array]:
        return {
            name: mx.array(array).astype(mx.float32 if name in self.float32_names else dtype)
            for name, array in self.arrays.items()
        }


@dataclass
class _Draft:
    """One raw checkpoint before writing: its config, backbone and MTP tensors."""

    config: dict[str, Any]
    backbone: _Tensors
    mtp: _Tensors


# --------------------------------------------------------------------------- shared blocks


def _swiglu_mlp(t: _Tensors, prefix: str, hidden: int, intermediate: int) -> None:
    t.matrix(f"{prefix}.gate_proj.weight", intermediate, hidden)
    t.matrix(f"{prefix}.up_proj.weight", intermediate, hidden)
    t.matrix(f"{prefix}.down_proj.weight", hidden, intermediate)


def _per_expert_experts(t: _Tensors, prefix: str, experts: int, hidden: int, inter: int) -> None:
    for e in range(experts):
        _swiglu_mlp(t, f"{prefix}.{e}", hidden, inter)


def _fused_experts(t: _Tensors, prefix: str, experts: int, hidden: int, inter: int) -> None:
    # transformers 5 layout: gate and up stacked on dim 1 (gate first), no `.weight` suffix.
    t.matrix(f"{prefix}.gate_up_proj", experts, 2 * inter, hidden)
    t.matrix(f"{prefix}.down_proj", experts, hidden, inter)


def _qwen_moe(t: _Tensors, prefix: str, cfg: dict[str, Any], *, fused: bool) -> None:
    hidden, experts = cfg["hidden_size"], cfg["num_experts"]
    t.matrix(f"{prefix}.gate.weight", experts, hidden)
    write_experts = _fused_experts if fused else _per_expert_experts
    write_experts(t, f"{prefix}.experts", experts, hidden, cfg["moe_intermediate_size"])
    _swiglu_mlp(t, f"{prefix}.shared_expert", hidden, cfg["shared_expert_intermediate_size"])
    t.matrix(f"{prefix}.shared_expert_gate.weight", 1, hidden)


def _qwen_gated_attention(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
    """Qwen3-Next/3.5 full attention: q_proj also yields the output gate, hence 2x rows."""
    hidden, heads, kv_heads, head_dim = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    t.matrix(f"{prefix}.q_proj.weight", 2 * heads * head_dim, hidden)
    t.matrix(f"{prefix}.k_proj.weight", kv_heads * head_dim, hidden)
    t.matrix(f"{prefix}.v_proj.weight", kv_heads * head_dim, hidden)
    t.matrix(f"{prefix}.o_proj.weight", hidden, heads * head_dim)
    t.norm(f"{prefix}.q_norm.weight", head_dim, zero_centred=True)
    t.norm(f"{prefix}.k_norm.weight", head_dim, zero_centred=True)


def _gated_delta_net_state(t: _Tensors, prefix: str, cfg: dict[str, Any], conv_dim: int) -> None:
    """The parts Qwen3-Next and Qwen3.5 gated-delta-net layers share."""
    value_heads = cfg["linear_num_value_heads"]
    # HF Conv1d layout [C, 1, K]; mlx-lm moves it to [C, K, 1] and keys its norm shift on that.
    t.normal(f"{prefix}.conv1d.weight", (conv_dim, 1, cfg["linear_conv_kernel_dim"]), std=0.1)
    t.put(f"{prefix}.dt_bias", t.uniform(f"{prefix}.dt_bias", (value_heads,), 0.5, 1.5))
    t.put(f"{prefix}.A_log", np.log(t.uniform(f"{prefix}.A_log", (value_heads,), 1.0, 16.0)))
    # The gated RMSNorm applies w, not (1 + w): it is not zero-centred.
    t.norm(f"{prefix}.norm.weight", cfg["linear_value_head_dim"], zero_centred=False)
    t.matrix(
        f"{prefix}.out_proj.weight",
        cfg["hidden_size"],
        value_heads * cfg["linear_value_head_dim"],
    )


def _linear_dims(cfg: dict[str, Any]) -> tuple[int, int]:
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    return key_dim, value_dim


def _qwen3_5_linear_attention(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
    hidden, value_heads = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key_dim, value_dim = _linear_dims(cfg)
    t.matrix(f"{prefix}.in_proj_qkv.weight", 2 * key_dim + value_dim, hidden)
    t.matrix(f"{prefix}.in_proj_z.weight", value_dim, hidden)
    t.matrix(f"{prefix}.in_proj_b.weight", value_heads, hidden)
    t.matrix(f"{prefix}.in_proj_a.weight", value_heads, hidden)
    _gated_delta_net_state(t, prefix, cfg, conv_dim=2 * key_dim + value_dim)


def _qwen3_next_linear_attention(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
    # Qwen3-Next packs q, k, v, z into one projection and b, a into another.
    hidden, value_heads = cfg["hidden_size"], cfg["linear_num_value_heads"]
    key_dim, value_dim = _linear_dims(cfg)
    t.matrix(f"{prefix}.in_proj_qkvz.weight", 2 * key_dim + 2 * value_dim, hidden)
    t.matrix(f"{prefix}.in_proj_ba.weight", 2 * value_heads, hidden)
    _gated_delta_net_state(t, prefix, cfg, conv_dim=2 * key_dim + value_dim)


_Block = Callable[[_Tensors, str, dict[str, Any]], None]


def _qwen_hybrid_model(
    t: _Tensors, cfg: dict[str, Any], prefix: str, linear_attention: _Block, mlp: _Block
) -> None:
    """Embeddings, layers and final norm of Qwen3-Next/3.5 under `prefix` (e.g. `model`)."""
    hidden = cfg["hidden_size"]
    t.matrix(f"{prefix}.embed_tokens.weight", cfg["vocab_size"], hidden, std=_EMBED_STD)
    for i, layer_type in enumerate(cfg["layer_types"]):
        layer = f"{prefix}.layers.{i}"
        t.norm(f"{layer}.input_layernorm.weight", hidden, zero_centred=True)
        if layer_type == "linear_attention":
            linear_attention(t, f"{layer}.linear_attn", cfg)
        else:
            _qwen_gated_attention(t, f"{layer}.self_attn", cfg)
        t.norm(f"{layer}.post_attention_layernorm.weight", hidden, zero_centred=True)
        mlp(t, f"{layer}.mlp", cfg)
    t.norm(f"{prefix}.norm.weight", hidden, zero_centred=True)


def _qwen_mtp(t: _Tensors, cfg: dict[str, Any], layers: int, mlp: _Block) -> None:
    """The top-level `mtp.*` head of Qwen3-Next/3.5/3.6: fc [H, 2H] and full-attention layers."""
    hidden = cfg["hidden_size"]
    t.matrix("mtp.fc.weight", hidden, 2 * hidden)
    t.norm("mtp.pre_fc_norm_embedding.weight", hidden, zero_centred=True)
    t.norm("mtp.pre_fc_norm_hidden.weight", hidden, zero_centred=True)
    for i in range(layers):
        layer = f"mtp.layers.{i}"
        t.norm(f"{layer}.input_layernorm.weight", hidden, zero_centred=True)
        _qwen_gated_attention(t, f"{layer}.self_attn", cfg)
        t.norm(f"{layer}.post_attention_layernorm.weight", hidden, zero_centred=True)
        mlp(t, f"{layer}.mlp", cfg)
    t.norm("mtp.norm.weight", hidden, zero_centred=True)


def _layer_types(layers: int, full_attention_interval: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(layers)
    ]


# --------------------------------------------------------------------------- Qwen3.5 / 3.6


def _qwen3_5_config(*, moe: bool, vocab_size: int, dtype: str) -> dict[str, Any]:
    """A Qwen3.5 VLM-style config (vision tower omitted: no `model.visual.*` tensors)."""
    text: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": _ENDOFTEXT_ID,
        "dtype": dtype,
        "eos_token_id": _ENDOFTEXT_ID,
        "full_attention_interval": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "layer_types": _layer_types(4, 4),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        # head_dim 32 * partial_rotary_factor 0.25 = 8 rotary dims; mrope_section sums to 8 / 2.
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if moe:
        # Intermediate sizes are multiples of 64 so 4-bit group-64 quantization covers them.
        text |= {
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 64,
        }
    else:
        text["intermediate_size"] = 128
    return {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": dict(sorted(text.items())),
        "tie_word_embeddings": False,
        "transformers_version": "5.2.0",
    }


def _qwen3_5_draft(seed: int, vocab_size: int, dtype: str, *, moe: str | None) -> _Draft:
    """Qwen3.5 dense (`moe=None`), Qwen3.5 MoE (`"per_expert"` MTP) or Qwen3.6 (`"fused"`)."""
    config = _qwen3_5_config(moe=moe is not None, vocab_size=vocab_size, dtype=dtype)
    cfg = config["text_config"]
    hidden = cfg["hidden_size"]

    def backbone_mlp(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
        if moe is None:
            _swiglu_mlp(t, prefix, hidden, cfg["intermediate_size"])
        else:
            # The published backbone stores fused experts in both Qwen3.5 and Qwen3.6 MoE.
            _qwen_moe(t, prefix, cfg, fused=True)

    def mtp_mlp(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
        if moe is None:
            _swiglu_mlp(t, prefix, hidden, cfg["intermediate_size"])
        else:
            _qwen_moe(t, prefix, cfg, fused=moe == "fused")

    backbone, mtp = _Tensors(seed), _Tensors(seed)
    _qwen_hybrid_model(
        backbone, cfg, "model.language_model", _qwen3_5_linear_attention, backbone_mlp
    )
    backbone.matrix("lm_head.weight", vocab_size, hidden, std=_EMBED_STD)
    _qwen_mtp(mtp, cfg, cfg["mtp_num_hidden_layers"], mtp_mlp)
    return _Draft(config, backbone, mtp)


# --------------------------------------------------------------------------- Qwen3-Next


def _qwen3_next_draft(seed: int, vocab_size: int, dtype: str) -> _Draft:
    # The real HF config declares no MTP field although the checkpoint holds `mtp.*`.
    config: dict[str, Any] = {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": _ENDOFTEXT_ID,
        "decoder_sparse_step": 1,
        "eos_token_id": _IM_END_ID,
        "full_attention_interval": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    cfg = config | {"layer_types": _layer_types(4, 4)}

    def mlp(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
        _qwen_moe(t, prefix, cfg, fused=False)

    backbone, mtp = _Tensors(seed), _Tensors(seed)
    _qwen_hybrid_model(backbone, cfg, "model", _qwen3_next_linear_attention, mlp)
    backbone.matrix("lm_head.weight", vocab_size, _HIDDEN, std=_EMBED_STD)
    _qwen_mtp(mtp, cfg, 1, mlp)
    return _Draft(config, backbone, mtp)


# --------------------------------------------------------------------------- DeepSeek-V3 / GLM


def _mla_attention(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    rope, nope, v_dim = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    t.matrix(f"{prefix}.q_a_proj.weight", q_rank, hidden)
    t.norm(f"{prefix}.q_a_layernorm.weight", q_rank, zero_centred=False)
    t.matrix(f"{prefix}.q_b_proj.weight", heads * (nope + rope), q_rank)
    t.matrix(f"{prefix}.kv_a_proj_with_mqa.weight", kv_rank + rope, hidden)
    t.norm(f"{prefix}.kv_a_layernorm.weight", kv_rank, zero_centred=False)
    t.matrix(f"{prefix}.kv_b_proj.weight", heads * (nope + v_dim), kv_rank)
    t.matrix(f"{prefix}.o_proj.weight", hidden, heads * v_dim)


def _glm_attention(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
    hidden, heads, kv_heads, head_dim = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    for proj, rows in (("q_proj", heads * head_dim), ("k_proj", kv_heads * head_dim)):
        t.matrix(f"{prefix}.{proj}.weight", rows, hidden)
        t.matrix(f"{prefix}.{proj}.bias", rows)
    t.matrix(f"{prefix}.v_proj.weight", kv_heads * head_dim, hidden)
    t.matrix(f"{prefix}.v_proj.bias", kv_heads * head_dim)
    t.matrix(f"{prefix}.o_proj.weight", hidden, heads * head_dim)
    t.norm(f"{prefix}.q_norm.weight", head_dim, zero_centred=False)
    t.norm(f"{prefix}.k_norm.weight", head_dim, zero_centred=False)


def _deepseek_style_layer(
    t: _Tensors, prefix: str, cfg: dict[str, Any], index: int, attention: _Block
) -> None:
    """A DeepSeek-V3/GLM-4.5 decoder layer: dense below first_k_dense_replace, MoE above."""
    hidden = cfg["hidden_size"]
    t.norm(f"{prefix}.input_layernorm.weight", hidden, zero_centred=False)
    attention(t, f"{prefix}.self_attn", cfg)
    t.norm(f"{prefix}.post_attention_layernorm.weight", hidden, zero_centred=False)
    mlp = f"{prefix}.mlp"
    if index < cfg["first_k_dense_replace"]:
        _swiglu_mlp(t, mlp, hidden, cfg["intermediate_size"])
        return
    experts, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    t.matrix(f"{mlp}.gate.weight", experts, hidden)
    bias = f"{mlp}.gate.e_score_correction_bias"
    t.put(bias, t.uniform(bias, (experts,), -0.01, 0.01), keep_float32=True)
    _per_expert_experts(t, f"{mlp}.experts", experts, hidden, inter)
    _swiglu_mlp(t, f"{mlp}.shared_experts", hidden, inter * cfg["n_shared_experts"])


def _deepseek_style_draft(
    seed: int, vocab_size: int, config: dict[str, Any], attention: _Block
) -> _Draft:
    """Backbone `model.*` plus the NextN layer at `model.layers.{num_hidden_layers}`."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    backbone, mtp = _Tensors(seed), _Tensors(seed)
    backbone.matrix("model.embed_tokens.weight", vocab_size, hidden, std=_EMBED_STD)
    for i in range(layers):
        _deepseek_style_layer(backbone, f"model.layers.{i}", config, i, attention)
    backbone.norm("model.norm.weight", hidden, zero_centred=False)
    backbone.matrix("lm_head.weight", vocab_size, hidden, std=_EMBED_STD)

    for i in range(config["num_nextn_predict_layers"]):
        nextn = f"model.layers.{layers + i}"
        # The published NextN layer carries its own copies of the embedding and the head.
        mtp.put(f"{nextn}.embed_tokens.weight", backbone.arrays["model.embed_tokens.weight"])
        mtp.norm(f"{nextn}.enorm.weight", hidden, zero_centred=False)
        mtp.norm(f"{nextn}.hnorm.weight", hidden, zero_centred=False)
        mtp.matrix(f"{nextn}.eh_proj.weight", hidden, 2 * hidden)
        _deepseek_style_layer(mtp, nextn, config, layers + i, attention)
        mtp.norm(f"{nextn}.shared_head.norm.weight", hidden, zero_centred=False)
        mtp.put(f"{nextn}.shared_head.head.weight", backbone.arrays["lm_head.weight"])
    return _Draft(config, backbone, mtp)


def _deepseek_v3_draft(seed: int, vocab_size: int, dtype: str) -> _Draft:
    # Real DeepSeek-V3 weights are FP8 with `weight_scale_inv`; these are plain, so the config
    # carries no `quantization_config`.
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": _ENDOFTEXT_ID,
        "eos_token_id": _IM_END_ID,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "kv_lora_rank": 32,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 32,
        "moe_layer_freq": 1,
        "n_group": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "num_nextn_predict_layers": 1,
        "pretraining_tp": 1,
        "q_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": dtype,
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 16,
        "vocab_size": vocab_size,
    }
    return _deepseek_style_draft(seed, vocab_size, config, _mla_attention)


def _glm4_moe_draft(seed: int, vocab_size: int, dtype: str) -> _Draft:
    # Three layers put the NextN layer at model.layers.3, a number no other fixture uses.
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": [_ENDOFTEXT_ID, _IM_END_ID],
        "first_k_dense_replace": 1,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 32,
        "n_group": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,
        "pad_token_id": _ENDOFTEXT_ID,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": dtype,
        "transformers_version": "4.54.0",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": vocab_size,
    }
    return _deepseek_style_draft(seed, vocab_size, config, _glm_attention)


# --------------------------------------------------------------------------- MiMo


def _qwen2_block(t: _Tensors, prefix: str, cfg: dict[str, Any]) -> None:
    """A Qwen2 decoder block: biased q/k/v, plain (not zero-centred) norms."""
    hidden, heads, kv_heads = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    head_dim = hidden // heads
    t.norm(f"{prefix}.input_layernorm.weight", hidden, zero_centred=False)
    attn = f"{prefix}.self_attn"
    for proj, rows in (
        ("q_proj", heads * head_dim),
        ("k_proj", kv_heads * head_dim),
        ("v_proj", kv_heads * head_dim),
    ):
        t.matrix(f"{attn}.{proj}.weight", rows, hidden)
        t.matrix(f"{attn}.{proj}.bias", rows)
    t.matrix(f"{attn}.o_proj.weight", hidden, heads * head_dim)
    t.norm(f"{prefix}.post_attention_layernorm.weight", hidden, zero_centred=False)
    _swiglu_mlp(t, f"{prefix}.mlp", hidden, cfg["intermediate_size"])


def _mimo_draft(seed: int, vocab_size: int, dtype: str) -> _Draft:
    # The published config also has an `auto_map` to remote code; the code files are not part of
    # the fixture, so neither is the map.
    config = {
        "architectures": ["MiMoForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": _ENDOFTEXT_ID,
        "eos_token_id": _IM_END_ID,
        "hidden_act": "silu",
        "hidden_size": _HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 32768,
        "max_window_layers": 2,
        "model_type": "mimo",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 640000,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }
    hidden = config["hidden_size"]
    backbone, mtp = _Tensors(seed), _Tensors(seed)
    backbone.matrix("model.embed_tokens.weight", vocab_size, hidden, std=_EMBED_STD)
    for i in range(config["num_hidden_layers"]):
        _qwen2_block(backbone, f"model.layers.{i}", config)
    backbone.norm("model.norm.weight", hidden, zero_centred=False)
    backbone.matrix("lm_head.weight", vocab_size, hidden, std=_EMBED_STD)
    for i in range(config["num_nextn_predict_layers"]):
        layer = f"model.mtp_layers.{i}"
        mtp.norm(f"{layer}.token_layernorm.weight", hidden, zero_centred=False)
        mtp.norm(f"{layer}.hidden_layernorm.weight", hidden, zero_centred=False)
        # Concat order is hidden first: input_proj(concat(hidden_norm(h), token_norm(emb))).
        mtp.matrix(f"{layer}.input_proj.weight", hidden, 2 * hidden)
        _qwen2_block(mtp, layer, config)
        mtp.norm(f"{layer}.final_layernorm.weight", hidden, zero_centred=False)
    return _Draft(config, backbone, mtp)


_RAW_DRAFTS: dict[str, Callable[[int, int, str], _Draft]] = {
    "qwen3_5": functools.partial(_qwen3_5_draft, moe=None),
    "qwen3_5_moe": functools.partial(_qwen3_5_draft, moe="per_expert"),
    "qwen3_6_moe": functools.partial(_qwen3_5_draft, moe="fused"),
    "qwen3_next": _qwen3_next_draft,
    "deepseek_v3": _deepseek_v3_draft,
    "glm4_moe": _glm4_moe_draft,
    "mimo": _mimo_draft,
    # The state of many re-uploads: the config still declares the head, the tensors are gone.
    "stripped": functools.partial(_qwen3_5_draft, moe=None),
}


# --------------------------------------------------------------------------- writing


def _shard_name(index: int, count: int) -> str:
    # A lone file is `model.safetensors` in both transformers' and mlx-lm's writers.
    return (
        "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    )


def _split_into_shards(
    backbone: dict[str, mx.array], mtp: dict[str, mx.array], shards: int
) -> list[dict[str, mx.array]]:
    """Backbone tensors in order over `shards` files; MTP tensors appended to the last one.

    The split depends only on the backbone, so a twin without MTP shards identically, and the
    last shard holds backbone tensors beside the MTP ones, as in the published checkpoints.
    """
    names = list(backbone)
    if len(names) < shards:
        raise ValueError(f"{len(names)} backbone tensors cannot fill {shards} shards")
    groups = [{name: backbone[name] for name in part} for part in np.array_split(names, shards)]
    groups[-1].update(mtp)
    return groups


def _write_shards(
    path: Path,
    groups: list[dict[str, mx.array]],
    *,
    file_format: str,
    extra_metadata: dict[str, Any] | None = None,
) -> None:
    """Write the shards and `model.safetensors.index.json` (weight_map sorted, as HF does)."""
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, group in enumerate(groups):
        name = _shard_name(i, len(groups))
        mx.save_safetensors(str(path / name), group, metadata={"format": file_format})
        weight_map.update(dict.fromkeys(group, name))
        total_size += sum(array.nbytes for array in group.values())
    index = {
        "metadata": {"total_size": total_size, **(extra_metadata or {})},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(path / "model.safetensors.index.json", index)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _build_raw(
    layout: str,
    path: Path,
    *,
    dtype: str,
    seed: int,
    shards: int,
    with_mtp: bool,
    vocab_size: int,
) -> None:
    draft = _RAW_DRAFTS[layout](seed, vocab_size, dtype)
    mx_dtype = getattr(mx, dtype)
    backbone = draft.backbone.to_mlx(mx_dtype)
    mtp = draft.mtp.to_mlx(mx_dtype) if with_mtp and layout != "stripped" else {}
    if shards == 1:
        # How transformers saves a model below its shard size: one file, no index.
        mx.save_safetensors(
            str(path / "model.safetensors"), backbone | mtp, metadata={"format": "pt"}
        )
    else:
        _write_shards(path, _split_into_shards(backbone, mtp, shards), file_format="pt")
    _write_json(path / "config.json", draft.config)
    write_tokenizer(path, vocab_size)


# --------------------------------------------------------------------------- MLX layouts

# Norms the Qwen3.5/3.6 checkpoints store zero-centred; the MLX side stores them +1.
_ZERO_CENTRED_MTP_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_PER_EXPERT_KEY = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _inline_mtp_tensors(
    raw_mtp: dict[str, mx.array], dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]], int]:
    """Raw Qwen3.5 MoE `mtp.*` tensors as the PR #990 builds store them.

    Returns the tensors (`language_model.mtp.*`, experts stacked into `switch_mlp`, norms
    shifted, linears quantized like the backbone), the per-path quantization overrides for the
    config, and the parameter count mlx-lm's index records.
    """
    staged: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for name, array in raw_mtp.items():
        if match := _PER_EXPERT_KEY.match(name):
            mlp, expert, proj = match.groups()
            experts.setdefault((mlp, proj), {})[int(expert)] = array
        else:
            staged[name] = array
    for (mlp, proj), by_expert in experts.items():
        staged[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack(
            [by_expert[e] for e in sorted(by_expert)]
        )

    tensors: dict[str, mx.array] = {}
    overrides: dict[str, dict[str, int]] = {}
    parameters = 0
    for name in sorted(staged):
        array = staged[name].astype(mx.float32)
        if array.ndim == 1 and name.endswith(_ZERO_CENTRED_MTP_NORMS):
            # Shift in float32, then cast: the precision note of MTP_FORMATS.md.
            array = array + 1.0
        array = array.astype(dtype)
        key = f"language_model.{name}"
        if array.ndim == 1 or not name.endswith(".weight"):
            tensors[key] = array
            parameters += array.size
            continue
        module = key.removesuffix(".weight")
        bits = _ROUTER_BITS if module.endswith(("mlp.gate", "shared_expert_gate")) else _Q_BITS
        if bits != _Q_BITS:
            overrides[module] = {"group_size": _Q_GROUP_SIZE, "bits": bits}
        weight, scales, biases = mx.quantize(array, group_size=_Q_GROUP_SIZE, bits=bits)
        tensors |= {
            f"{module}.weight": weight,
            f"{module}.scales": scales,
            f"{module}.biases": biases,
        }
        parameters += weight.size * 32 // bits
    return tensors, overrides, parameters


def _build_mlx(
    layout: str,
    path: Path,
    *,
    dtype: str,
    seed: int,
    shards: int,
    with_mtp: bool,
    vocab_size: int,
) -> None:
    """Convert a raw fixture with stock `mlx_lm.convert`, then graft the inline MTP head.

    Stock mlx-lm writes a single `model.safetensors` for a model this small; the tensors are
    re-split over `shards` files (mlx-lm's format otherwise unchanged) so the layout matches
    the multi-shard published builds.
    """
    from mlx_lm.convert import convert
    from mlx_lm.utils import save_config

    inline = layout == "mlx_inline"
    with tempfile.TemporaryDirectory(prefix="mtpkit-fixture-") as tmp:
        raw, converted = Path(tmp) / "hf", Path(tmp) / "mlx"
        # A float32 source makes mlx-lm's +1 norm shift happen in float32 before the cast.
        build_checkpoint(
            "qwen3_5_moe" if inline else "qwen3_5",
            raw,
            dtype="float32",
            seed=seed,
            shards=2,
            with_mtp=inline,
            vocab_size=vocab_size,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            convert(
                str(raw),
                str(converted),
                quantize=True,
                q_group_size=_Q_GROUP_SIZE,
                q_bits=_Q_BITS,
                dtype=dtype,
            )

        config = json.loads((converted / "config.json").read_text())
        # Published builds come from bfloat16 sources; the float32 source above is only a
        # fixture device, so the copied config records the dtype the weights are stored in.
        config["text_config"]["dtype"] = dtype
        metadata = json.loads((converted / "model.safetensors.index.json").read_text())["metadata"]
        weights: dict[str, mx.array] = {}
        for shard in sorted(converted.glob("model*.safetensors")):
            weights |= mx.load(str(shard))

        mtp: dict[str, mx.array] = {}
        if inline and with_mtp:
            raw_tensors: dict[str, mx.array] = {}
            for shard in sorted(raw.glob("model*.safetensors")):
                raw_tensors |= mx.load(str(shard))
            raw_mtp = {k: v for k, v in raw_tensors.items() if k.startswith("mtp.")}
            mtp, overrides, mtp_parameters = _inline_mtp_tensors(raw_mtp, getattr(mx, dtype))
            config["quantization"] |= overrides
            metadata["total_parameters"] += mtp_parameters

        path.mkdir(parents=True, exist_ok=True)
        for item in converted.iterdir():
            if not item.name.startswith("model"):
                shutil.copy(item, path / item.name)
        _write_shards(
            path,
            _split_into_shards(weights, mtp, shards),
            file_format="mlx",
            extra_metadata={k: v for k, v in metadata.items() if k != "total_size"},
        )
        # save_config also mirrors `quantization` into `quantization_config`, as stock does.
        save_config(config, path / "config.json")


# --------------------------------------------------------------------------- public API


def build_checkpoint(
    layout: str,
    path: Path,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    shards: int = 2,
    with_mtp: bool = True,
    vocab_size: int = 512,
) -> Path:
    """Write a tiny checkpoint of `layout` (one of FAMILIES) into `path` and return `path`.

    Raw layouts write weights in `dtype` over `shards` files plus the index (shards=1 writes a
    lone `model.safetensors`, as transformers does for small models). `with_mtp=False` writes
    the same backbone, bit for bit, without MTP tensors; the config keeps its MTP declaration.
    `stripped` never has MTP tensors, `mlx_plain` never has any either.

    MoE layouts need `dtype="float32"` to run on MLX's CPU backend (GatherMM is float32-only).
    The MLX layouts are converted from a float32 source and quantized 4-bit (group 64, routers
    8-bit); `dtype` is their non-quantized dtype (as `mlx_lm.convert --dtype`).
    """
    if layout not in FAMILIES:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(FAMILIES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    path = Path(path)
    # Leftover shards from an earlier build would be read as part of this checkpoint.
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty; build fixtures into an empty directory")
    path.mkdir(parents=True, exist_ok=True)
    build = _build_mlx if layout in MLX_LAYOUTS else _build_raw
    build(
        layout,
        path,
        dtype=dtype,
        seed=seed,
        shards=shards,
        with_mtp=with_mtp,
        vocab_size=vocab_size,
    )
    return path


# --------------------------------------------------------------------------- tokenizer

_TOKENIZER_CORPUS = """\
Multi-token prediction trains a model to guess more than one token ahead. At inference time
the extra head drafts the next token while the backbone verifies it, so a single forward pass
can confirm two tokens instead of one. When the draft is right, generation runs faster; when it
is wrong, nothing is lost, because the backbone's own choice replaces it.
Hello world! The quick brown fox jumps over the lazy dog, and the dog does not mind at all.
Apple silicon keeps weights in unified memory, which lets the processor and the graphics cores
read the same arrays without copying them. MLX is an array framework built for that design.
A checkpoint on the Hugging Face Hub stores its tensors in safetensors files. Large models are
split into shards, and an index file maps every tensor name to the shard that holds it. The
configuration file records the model type, the hidden size, the number of layers and heads,
and the size of the vocabulary. A tokenizer turns text into numbers and numbers back into text:
byte-level byte-pair encoding starts from the 256 possible bytes and merges frequent pairs.
Questions and answers, numbers like 1, 2, 3, 10, 42 and 2026, and punctuation such as commas,
colons: semicolons; dashes - and quotes "like these" all appear in ordinary English prose.
"""


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer once per vocab size and process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(TOKENIZER_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the 256 bytes plus special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TOKENIZER_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TOKENIZER_CORPUS], trainer)
    return tokenizer.to_str(pretty=True)


_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """Write a real byte-level BPE tokenizer (at most `vocab_size` tokens) into `path`.

    Writes `tokenizer.json`, `tokenizer_config.json` (ChatML template, eos `<|im_end|>`) and
    `generation_config.json`. `PreTrainedTokenizerFast` loads `tokenizer.json` verbatim, which
    model-specific classes (Qwen2Tokenizer, ...) in transformers 5 do not promise.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab_size))
    added_tokens = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(TOKENIZER_SPECIAL_TOKENS)
    }
    _write_json(
        path / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": _CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": _ENDOFTEXT_ID,
            "do_sample": True,
            "eos_token_id": [_IM_END_ID, _ENDOFTEXT_ID],
            "pad_token_id": _ENDOFTEXT_ID,
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "transformers_version": "4.57.0",
        },
    )
