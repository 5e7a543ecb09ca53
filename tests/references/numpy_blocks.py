"""Float32 numpy forwards of the MTP steps, written from vLLM's `*_mtp.py` equations.

Independent of MLX and of mtpkit: the weights come straight from the raw checkpoint (the
names a Hugging Face repo uses) and every block is written out here. `tests/
test_head_references.py` compares the MLX heads against these.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Weights = dict[str, np.ndarray]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def swiglu_mlp(w: Weights, prefix: str, x: np.ndarray) -> np.ndarray:
    gate = x @ w[f"{prefix}.gate_proj.weight"].T
    up = x @ w[f"{prefix}.up_proj.weight"].T
    return (silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


def rope(x: np.ndarray, positions: np.ndarray, theta: float, interleaved: bool) -> np.ndarray:
    """Rotary embedding of x [heads, S, D] over all D dims: pairs (2j, 2j+1) when
    `interleaved` (GPT-J style, vLLM's is_neox_style=False), else (j, j + D/2)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # [S, D/2]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def attention(
    w: Weights,
    prefix: str,
    x: np.ndarray,
    cfg: dict[str, Any],
    *,
    interleaved: bool,
    qk_norm: bool = False,
    window: int | None = None,
) -> np.ndarray:
    """Causal GQA self-attention over x [S, H] at positions 0..S-1 (optionally windowed)."""
    heads, kv_heads, head_dim = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    s = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].T).reshape(s, heads, head_dim).transpose(1, 0, 2)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).reshape(s, kv_heads, head_dim).transpose(1, 0, 2)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).reshape(s, kv_heads, head_dim).transpose(1, 0, 2)
    if qk_norm:
        q = rms_norm(q, w[f"{prefix}.q_norm.weight"], cfg["rms_norm_eps"])
        k = rms_norm(k, w[f"{prefix}.k_norm.weight"], cfg["rms_norm_eps"])
    positions = np.arange(s)
    q = rope(q, positions, cfg["rope_theta"], interleaved)
    k = rope(k, positions, cfg["rope_theta"], interleaved)
    k = np.repeat(k, heads // kv_heads, axis=0)
    v = np.repeat(v, heads // kv_heads, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim)
    allowed = np.tril(np.ones((s, s), dtype=bool))
    if window is not None:
        allowed &= np.triu(np.ones((s, s), dtype=bool), -(window - 1))
    scores = np.where(allowed, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = (probs @ v).transpose(1, 0, 2).reshape(s, heads * head_dim)
    return out @ w[f"{prefix}.o_proj.weight"].T


def pre_norm_block(
    w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any], attn: Any, mlp: Any
) -> np.ndarray:
    """x + attn(norm(x)), then h + mlp(norm(h)): the Llama-style decoder layer."""
    eps = cfg["rms_norm_eps"]
    h = x + attn(rms_norm(x, w[f"{prefix}.input_layernorm.weight"], eps))
    return h + mlp(rms_norm(h, w[f"{prefix}.post_attention_layernorm.weight"], eps))


# -- ERNIE-4.5 (vLLM ernie_mtp.py: LlamaDecoderLayer block, no norm before the lm_head) ----


def ernie_mtp_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """Logits [S, V] of ERNIE's MTP layer for hidden [S, H] and next tokens [S]."""
    eps = cfg["rms_norm_eps"]
    embed = w["model.embed_tokens.weight"]
    e = rms_norm(embed[tokens], w[f"model.mtp_emb_norm.{layer}.weight"], eps)
    h = rms_norm(hidden, w[f"model.mtp_hidden_norm.{layer}.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ w[f"model.mtp_linear_proj.{layer}.weight"].T
    block = f"model.mtp_block.{layer}"
    x = pre_norm_block(
        w,
        block,
        x,
        cfg,
        lambda y: attention(w, f"{block}.self_attn", y, cfg, interleaved=True),
        lambda y: swiglu_mlp(w, f"{block}.mlp", y),
    )
    head = embed if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T


# -- EXAONE MoE (vLLM exaone_moe_mtp.py: Qwen-style fc and norms, dense is_mtp layer) ------


def exaone_mtp_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """Logits [S, V] of EXAONE MoE's MTP layer for hidden [S, H] and next tokens [S]."""
    eps = cfg["rms_norm_eps"]
    e = rms_norm(w["model.embed_tokens.weight"][tokens], w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ w["mtp.fc.weight"].T
    types = cfg.get("mtp_layer_types") or cfg["layer_types"]
    window = cfg["sliding_window"] if types[layer] == "sliding_attention" else None
    block = f"mtp.layers.{layer}"
    x = pre_norm_block(
        w,
        block,
        x,
        cfg,
        lambda y: attention(
            w, f"{block}.self_attn", y, cfg, interleaved=False, qk_norm=True, window=window
        ),
        lambda y: swiglu_mlp(w, f"{block}.mlp", y),
    )
    return rms_norm(x, w["mtp.norm.weight"], eps) @ w["lm_head.weight"].T


# -- MiMo-V2-Flash (vLLM mimo_v2_flash_mtp.py: nextn parts, sliding-window block, sink) -----


def partial_rope(x: np.ndarray, positions: np.ndarray, theta: float, dims: int) -> np.ndarray:
    """Neox-style rotary embedding over the first `dims` of x's last axis; the rest passes."""
    rotated = rope(x[..., :dims], positions, theta, interleaved=False)
    return np.concatenate([rotated, x[..., dims:]], axis=-1)


def sink_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray | None, window: int | None
) -> np.ndarray:
    """Causal attention of q [heads, S, D] over k, v [heads, S, *] with an optional
    per-head sink logit that joins every softmax and attends to nothing."""
    s = q.shape[1]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    allowed = np.tril(np.ones((s, s), dtype=bool))
    if window is not None:
        allowed &= np.triu(np.ones((s, s), dtype=bool), -(window - 1))
    scores = np.where(allowed, scores, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(sinks[:, None, None], (*scores.shape[:2], 1))
        scores = np.concatenate([scores, column], axis=-1)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return probs[..., :s] @ v


def mimo_v2_swa_attention(
    w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]
) -> np.ndarray:
    """MiMo-V2's sliding-window attention: q/k heads of `swa_head_dim`, v heads of
    `swa_v_head_dim` scaled by `attention_value_scale`, partial rotary, a sink per head."""
    heads, kv_heads = cfg["swa_num_attention_heads"], cfg["swa_num_key_value_heads"]
    head_dim, v_dim = cfg["swa_head_dim"], cfg["swa_v_head_dim"]
    s = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].T).reshape(s, heads, head_dim).transpose(1, 0, 2)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).reshape(s, kv_heads, head_dim).transpose(1, 0, 2)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).reshape(s, kv_heads, v_dim).transpose(1, 0, 2)
    v = v * cfg.get("attention_value_scale", 1.0)
    dims = int(cfg["partial_rotary_factor"] * head_dim)
    positions = np.arange(s)
    q = partial_rope(q, positions, cfg["swa_rope_theta"], dims)
    k = partial_rope(k, positions, cfg["swa_rope_theta"], dims)
    k = np.repeat(k, heads // kv_heads, axis=0)
    v = np.repeat(v, heads // kv_heads, axis=0)
    sinks = w.get(f"{prefix}.attention_sink_bias")
    out = sink_attention(q, k, v, sinks, cfg["sliding_window_size"])
    return out.transpose(1, 0, 2).reshape(s, heads * v_dim) @ w[f"{prefix}.o_proj.weight"].T


def mimo_v2_flash_mtp_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """Logits [S, V] of MiMo-V2-Flash's MTP layer `layer` for hidden [S, H] and next tokens."""
    eps = cfg["layernorm_epsilon"]
    p = f"model.mtp.layers.{layer}"
    e = rms_norm(w["model.embed_tokens.weight"][tokens], w[f"{p}.enorm.weight"], eps)
    h = rms_norm(hidden, w[f"{p}.hnorm.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ w[f"{p}.eh_proj.weight"].T
    x = x + mimo_v2_swa_attention(
        w, f"{p}.self_attn", rms_norm(x, w[f"{p}.input_layernorm.weight"], eps), cfg
    )
    x = x + swiglu_mlp(w, f"{p}.mlp", rms_norm(x, w[f"{p}.pre_mlp_layernorm.weight"], eps))
    return rms_norm(x, w[f"{p}.final_layernorm.weight"], eps) @ w["lm_head.weight"].T


# -- Step-3.5 (vLLM step3p5_mtp.py: nextn parts, GemmaRMSNorm everywhere, Step3p5 block) ---


def gemma_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """vLLM's GemmaRMSNorm: the stored weight is zero-centred, the model applies 1 + w."""
    return rms_norm(x, 1.0 + w, eps)


def step3p5_attention(
    w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any], index: int
) -> np.ndarray:
    """Step3p5Attention of layer `index`: per-head zero-centred q/k norms, partial rotary
    with the layer's base, sliding window by `layer_types`, a sigmoid gate per head."""
    eps, head_dim = cfg["rms_norm_eps"], cfg["head_dim"]
    sliding = cfg["layer_types"][index] == "sliding_attention"
    kv_heads = cfg["num_attention_groups"]
    heads = cfg["num_attention_heads"]
    other = cfg.get("attention_other_setting")
    if sliding and other:
        heads, kv_heads = other["num_attention_heads"], other["num_attention_groups"]
    s = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].T).reshape(s, heads, head_dim)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).reshape(s, kv_heads, head_dim)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).reshape(s, kv_heads, head_dim).transpose(1, 0, 2)
    q = gemma_rms_norm(q, w[f"{prefix}.q_norm.weight"], eps).transpose(1, 0, 2)
    k = gemma_rms_norm(k, w[f"{prefix}.k_norm.weight"], eps).transpose(1, 0, 2)
    theta = cfg["rope_theta"][index] if isinstance(cfg["rope_theta"], list) else cfg["rope_theta"]
    dims = int(head_dim * cfg["partial_rotary_factors"][index])
    positions = np.arange(s)
    q, k = partial_rope(q, positions, theta, dims), partial_rope(k, positions, theta, dims)
    k = np.repeat(k, heads // kv_heads, axis=0)
    v = np.repeat(v, heads // kv_heads, axis=0)
    out = sink_attention(q, k, v, None, cfg["sliding_window"] if sliding else None)
    gate = 1.0 / (1.0 + np.exp(-(x @ w[f"{prefix}.g_proj.weight"].T)))  # [S, heads]
    out = out.transpose(1, 0, 2) * gate[..., None]
    return out.reshape(s, heads * head_dim) @ w[f"{prefix}.o_proj.weight"].T


def clamped_swiglu_mlp(w: Weights, prefix: str, x: np.ndarray, limit: float) -> np.ndarray:
    """SwiGLU whose activated gate is capped at `limit` and up projection clipped to
    [-limit, limit] (Step-3.5's `swiglu_limits`); no clamp when the limit is 0."""
    gate = silu(x @ w[f"{prefix}.gate_proj.weight"].T)
    up = x @ w[f"{prefix}.up_proj.weight"].T
    if limit:
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    return (gate * up) @ w[f"{prefix}.down_proj.weight"].T


def step3p5_mtp_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """Logits [S, V] of Step-3.5's MTP layer `layer` (a dense one, as every published MTP
    layer is: `moe_layers_enum` stops at the trunk) for hidden [S, H] and next tokens [S]."""
    eps = cfg["rms_norm_eps"]
    index = cfg["num_hidden_layers"] + layer
    p = f"model.layers.{index}"
    e = gemma_rms_norm(w["model.embed_tokens.weight"][tokens], w[f"{p}.enorm.weight"], eps)
    h = gemma_rms_norm(hidden, w[f"{p}.hnorm.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ w[f"{p}.eh_proj.weight"].T
    y = gemma_rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
    x = x + step3p5_attention(w, f"{p}.self_attn", y, cfg, index)
    y = gemma_rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    x = x + clamped_swiglu_mlp(w, f"{p}.mlp", y, cfg["swiglu_limits_shared"][index])
    x = gemma_rms_norm(x, w[f"{p}.transformer.shared_head.norm.weight"], eps)
    return x @ w[f"{p}.transformer.shared_head.output.weight"].T


# -- Nemotron-H (vLLM nemotron_h_mtp.py: one MTP layer = blocks of the `mtp` pattern) -------


def relu2_mlp(w: Weights, prefix: str, x: np.ndarray) -> np.ndarray:
    """Nemotron-H's non-gated MLP: down(relu(up(x))^2)."""
    return (
        np.maximum(x @ w[f"{prefix}.up_proj.weight"].T, 0.0) ** 2
        @ w[f"{prefix}.down_proj.weight"].T
    )


def nemotron_moe(w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """Sigmoid router with the correction bias choosing the top k (its scores weigh them,
    normalised and scaled), ReLU^2 experts in the latent space, shared experts."""
    scores = 1.0 / (1.0 + np.exp(-(x @ w[f"{prefix}.gate.weight"].T)))  # [S, E]
    chosen = scores + w[f"{prefix}.gate.e_score_correction_bias"]
    k = cfg["num_experts_per_tok"]
    latent = x
    if cfg.get("moe_latent_size"):
        latent = x @ w[f"{prefix}.fc1_latent_proj.weight"].T
    out = np.zeros_like(latent)
    for s in range(x.shape[0]):
        top = np.argsort(-chosen[s])[:k]
        weights = scores[s, top]
        if cfg["norm_topk_prob"]:
            weights = weights / (weights.sum() + 1e-20)
        for e, weight in zip(top, weights * cfg["routed_scaling_factor"], strict=True):
            out[s] += weight * relu2_mlp(w, f"{prefix}.experts.{e}", latent[s : s + 1])[0]
    if cfg.get("moe_latent_size"):
        out = out @ w[f"{prefix}.fc2_latent_proj.weight"].T
    return out + relu2_mlp(w, f"{prefix}.shared_experts", x)


def nope_attention(w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """Nemotron-H's causal GQA attention: no positional encoding at all."""
    heads, kv_heads, head_dim = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    s = x.shape[0]
    q = (x @ w[f"{prefix}.q_proj.weight"].T).reshape(s, heads, head_dim).transpose(1, 0, 2)
    k = (x @ w[f"{prefix}.k_proj.weight"].T).reshape(s, kv_heads, head_dim).transpose(1, 0, 2)
    v = (x @ w[f"{prefix}.v_proj.weight"].T).reshape(s, kv_heads, head_dim).transpose(1, 0, 2)
    k = np.repeat(k, heads // kv_heads, axis=0)
    v = np.repeat(v, heads // kv_heads, axis=0)
    out = sink_attention(q, k, v, None, None)
    return out.transpose(1, 0, 2).reshape(s, heads * head_dim) @ w[f"{prefix}.o_proj.weight"].T


def nemotron_h_mtp_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """Logits [S, V] of Nemotron-H's MTP layer `layer` (its blocks `mtp.layers.{layer * P +
    j}`, P the pattern's length) for hidden [S, H] and next tokens [S]."""
    eps = cfg["layer_norm_epsilon"]
    pattern = cfg["mtp_hybrid_override_pattern"]
    blocks = [f"mtp.layers.{layer * len(pattern) + j}" for j in range(len(pattern))]
    first, last = blocks[0], blocks[-1]
    e = rms_norm(w["backbone.embeddings.weight"][tokens], w[f"{first}.enorm.weight"], eps)
    h = rms_norm(hidden, w[f"{first}.hnorm.weight"], eps)
    x = np.concatenate([e, h], axis=-1) @ w[f"{first}.eh_proj.weight"].T
    for block, kind in zip(blocks, pattern, strict=True):
        y = rms_norm(x, w[f"{block}.norm.weight"], eps)
        if kind == "*":
            x = x + nope_attention(w, f"{block}.mixer", y, cfg)
        elif kind == "E":
            x = x + nemotron_moe(w, f"{block}.mixer", y, cfg)
        else:
            x = x + relu2_mlp(w, f"{block}.mixer", y)
    return rms_norm(x, w[f"{last}.final_layernorm.weight"], eps) @ w["lm_head.weight"].T
