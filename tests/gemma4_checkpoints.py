"""Tiny Gemma 4 targets and assistants in their published on-disk formats, for tests.

A target is written as `google/gemma-4-E2B-it` is (`model_type` `gemma4`, the text model
under `model.language_model.`, per-layer inputs, KV-shared layers without K/V projections),
or text-only (`gemma4_text`, under `model.`). An assistant as `google/gemma-4-E2B-it-assistant`
is (`gemma4_assistant`: `pre_projection`, `post_projection`, four query-only layers under
`model.layers`, the tied `model.embed_tokens`, and with `ordered=True` the centroid head
`masked_embedding.centroids` plus its int64 `token_ordering`). Only the sizes are tiny, and the
sliding window (8) is short so that tests cross it.

Tensor names come from stock mlx-lm's own `gemma4_text` parameter tree (which is transformers'
tree after mlx-lm's `sanitize`); `scripts/gemma4_reference.py` loads the same files into
transformers' `Gemma4ForCausalLM` and `Gemma4AssistantForCausalLM` with strict key checks, so a
name that drifts from the real format fails there.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from tests.checkpoints import write_tokenizer
from tests.fixtures.tensors import EMBED_STD, Tensors

VOCAB = 512
WINDOW = 8
TARGET_HIDDEN = 64
ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}

TARGET_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": TARGET_HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 2,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "sliding_window": WINDOW,
    "final_logit_softcapping": 30.0,
    "use_double_wide_mlp": True,
    "enable_moe_block": False,
    "attention_k_eq_v": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_parameters": ROPE,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

ASSISTANT_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "vocab_size": VOCAB,
    "vocab_size_per_layer_input": 0,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 4,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "sliding_window": WINDOW,
    "final_logit_softcapping": None,
    "use_double_wide_mlp": False,
    "enable_moe_block": False,
    "attention_k_eq_v": False,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "rope_parameters": ROPE,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def _fill(t: Tensors, shapes: dict[str, tuple[int, ...]]) -> None:
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if leaf == "layer_scalar":
            t.normal(name, shape, std=0.05, mean=1.0)
        elif len(shape) == 1:  # RMSNorm scales (plain in Gemma 4: applied as w, not 1 + w)
            t.norm(name, shape[0], zero_centred=False)
        elif "embed_tokens" in name:
            t.matrix(name, *shape, std=EMBED_STD)
        else:
            t.matrix(name, *shape, std=0.08)


def two_token(tensors: dict[str, mx.array], table: str, norm: str, sign: float) -> None:
    """Make a model answer token 10 or token 11 whatever the context: its final norm keeps
    one dimension, and its tied table's column there picks 10 or 11 by the sign of that
    dimension (`sign` flips which). A target and an assistant so made agree on most steps
    (tests of rounds that keep some drafts and reject others)."""
    weights = np.array(tensors[norm].astype(mx.float32))
    weights[:] = 0.0
    weights[0] = 1.0
    rows = np.array(tensors[table].astype(mx.float32))
    rows[10, 0], rows[11, 0] = 3.0 * sign, -3.0 * sign
    tensors[norm] = mx.array(weights).astype(tensors[norm].dtype)
    tensors[table] = mx.array(rows).astype(tensors[table].dtype)


def _text_shapes(text: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Stock mlx-lm's gemma4_text parameter tree (`model.*`) for a text config."""
    from mtpkit.mlxlm import mlx_lm_models

    arch = mlx_lm_models("gemma4_text")
    args = arch.ModelArgs.from_dict(text)
    if args.num_kv_shared_layers < args.num_hidden_layers:
        model = arch.Model(args)
        return {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    # An assistant (every layer KV-shared): mlx-lm's text model wants a K/V-computing layer,
    # so its tree is put together from the same classes.
    import mlx.nn as nn

    model = nn.Module()
    model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
    model.layers = [arch.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
    model.norm = nn.RMSNorm(args.hidden_size)
    return {f"model.{k}": tuple(v.shape) for k, v in tree_flatten(model.parameters())}


def _save(path: Path, tensors: dict[str, mx.array], config: dict[str, Any], shards: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    groups = [list(part) for part in np.array_split(names, shards)] if shards > 1 else [names]
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        shard = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        part = {n: tensors[n] for n in group}
        mx.save_safetensors(str(path / shard), part, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, shard))
        total += sum(a.nbytes for a in part.values())
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json_text(index))
    (path / "config.json").write_text(json_text(config))


def json_text(data: Any) -> str:
    import json

    return json.dumps(data, indent=2) + "\n"


def target_config(
    text_only: bool = False, dtype: str = "bfloat16", **overrides: Any
) -> dict[str, Any]:
    text = {**copy.deepcopy(TARGET_TEXT), **overrides}
    if text_only:
        return {**text, "architectures": ["Gemma4ForCausalLM"]}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": True,
        "image_token_id": 258880,
        "boi_token_id": 255999,
        "eoi_token_id": 258882,
        "torch_dtype": dtype,  # the weights' dtype (convert's default, as mlx_lm.convert's)
    }


# The 26B-A4B's layout: a MoE block beside the dense MLP, K-eq-V full layers with their own
# K/V head count, no per-layer inputs, no KV-shared layers.
MOE_TEXT: dict[str, Any] = {
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "num_key_value_heads": 2,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "use_double_wide_mlp": False,
}


def _fused_experts(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's `experts.switch_glu.*` back to transformers' fused 3-D `experts.gate_up_proj`
    (gate rows first) and `experts.down_proj`, as the published MoE checkpoint stores them."""
    out: dict[str, mx.array] = {}
    for name, array in tensors.items():
        if name.endswith(".experts.switch_glu.gate_proj.weight"):
            base = name.removesuffix(".switch_glu.gate_proj.weight")
            up = tensors[f"{base}.switch_glu.up_proj.weight"]
            out[f"{base}.gate_up_proj"] = mx.concatenate([array, up], axis=-2)
        elif name.endswith(".experts.switch_glu.down_proj.weight"):
            out[name.removesuffix(".switch_glu.down_proj.weight") + ".down_proj"] = array
        elif not name.endswith(".experts.switch_glu.up_proj.weight"):
            out[name] = array
    return out


def build_target(
    path: Path,
    *,
    text_only: bool = False,
    moe: bool = False,
    dtype: str = "float32",
    seed: int = 0,
    shards: int = 2,
    agreeing: bool = False,
) -> Path:
    """A tiny Gemma 4 target at `path`: E2B-like (per-layer inputs, 2 KV-shared layers), or
    with `moe` 26B-A4B-like (fused experts, K-eq-V full layers); `agreeing`: see
    `two_token`."""
    config = target_config(text_only, dtype, **(MOE_TEXT if moe else {}))
    text = config if text_only else config["text_config"]
    t = Tensors(seed)
    _fill(t, _text_shapes(text))
    prefix = "model." if text_only else "model.language_model."
    tensors = {
        prefix + name.removeprefix("model."): array
        for name, array in _fused_experts(t.to_mlx(getattr(mx, dtype))).items()
    }
    if agreeing:
        two_token(tensors, prefix + "embed_tokens.weight", prefix + "norm.weight", 1.0)
    if not text_only:  # the vision tower mlx-lm (and mtpkit) drop: one tensor stands for it
        tensors["model.vision_tower.patch_embedder.input_proj.weight"] = mx.zeros(
            (8, 12), dtype=getattr(mx, dtype)
        )
    _save(Path(path), tensors, config, shards)
    write_tokenizer(path, VOCAB)
    return Path(path)


def assistant_config(*, ordered: bool = False, **text_overrides: Any) -> dict[str, Any]:
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": TARGET_HIDDEN,
        "use_ordered_embeddings": ordered,
        "num_centroids": 16,
        "centroid_intermediate_top_k": 4,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "text_config": {**copy.deepcopy(ASSISTANT_TEXT), **text_overrides},
    }


def build_assistant(
    path: Path,
    *,
    ordered: bool = False,
    dtype: str = "float32",
    seed: int = 1,
    shards: int = 1,
    with_lm_head: bool = False,
    config: dict[str, Any] | None = None,
    agreeing: bool = False,
) -> Path:
    """A tiny Gemma 4 assistant for `build_target`'s target at `path` (`ordered`: the
    centroid-masked head of the E2B/E4B assistants). `with_lm_head` also writes the tied head
    as its own tensor, as some exports do; `agreeing`: see `two_token`."""
    config = config or assistant_config(ordered=ordered)
    text = config["text_config"]
    hidden, backbone = text["hidden_size"], config["backbone_hidden_size"]
    shapes = {
        k: v
        for k, v in _text_shapes(text).items()
        if not k.startswith("lm_head") and "per_layer" not in k
    }
    shapes["pre_projection.weight"] = (hidden, 2 * backbone)
    shapes["post_projection.weight"] = (backbone, hidden)
    if config["use_ordered_embeddings"]:
        shapes["masked_embedding.centroids.weight"] = (config["num_centroids"], hidden)
    t = Tensors(seed)
    _fill(t, shapes)
    tensors = t.to_mlx(getattr(mx, dtype))
    if config["use_ordered_embeddings"]:
        order = np.random.default_rng(seed).permutation(text["vocab_size"])
        tensors["masked_embedding.token_ordering"] = mx.array(order.astype(np.int64))
    if agreeing:  # with `build_target(agreeing=True)`: the sign that agrees (fixed seeds)
        two_token(tensors, "model.embed_tokens.weight", "model.norm.weight", -1.0)
    if with_lm_head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    _save(Path(path), tensors, config, shards)
    return Path(path)
