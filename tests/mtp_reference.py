"""Float32 numpy forwards of MTP steps, written from vLLM's and the model authors' equations.

Independent of mlx-lm and of mtpkit: the weights are read from the raw Hugging Face
checkpoint (the names it publishes) and every block is spelled out here. Sources:
vLLM `deepseek_mtp.py` / `glm4_moe_lite_mtp.py` (the nextn step), transformers
`modeling_deepseek_v3.py` (MLA, the noaux_tc router, YaRN's attention scale), DeepSeek-V3.2's
reference `inference/model.py` (the DSA indexer; its Hadamard rotation is orthonormal, so it
leaves the scores unchanged and is left out).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

Weights = dict[str, np.ndarray]


def load_raw(path: Path) -> Weights:
    """Every tensor of a raw float32 checkpoint, by its published name."""
    out: Weights = {}
    for shard in sorted(Path(path).glob("model*.safetensors")):
        out.update({k: v.astype(np.float32) for k, v in load_file(str(shard)).items()})
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


# --------------------------------------------------------------------------- rotary


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, base: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Angular frequencies of the rotated pairs; YaRN as DeepSeek's `precompute_freqs_cis`."""
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not scaling or scaling.get("type", scaling.get("rope_type")) != "yarn":
        return freqs
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(scaling["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(scaling["beta_slow"])), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


def rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate x [..., S, D] at `positions`: pairs (2i, 2i+1) when interleaved, else (i, i+D/2)."""
    angles = positions[:, None] * freqs[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if params is not None:
        return float(params["rope_theta"]), params
    return float(cfg["rope_theta"]), cfg.get("rope_scaling")


# --------------------------------------------------------------------------- blocks


def linear(w: Weights, name: str, x: np.ndarray) -> np.ndarray:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def swiglu(w: Weights, prefix: str, x: np.ndarray) -> np.ndarray:
    return linear(w, f"{prefix}.down_proj", silu(linear(w, f"{prefix}.gate_proj", x)) * linear(
        w, f"{prefix}.up_proj", x
    ))  # fmt: skip


def noaux_tc_moe(w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """DeepSeek-V3's sigmoid router with the bias-corrected, group-limited top-k."""
    experts, top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    n_group, topk_group = cfg["n_group"], cfg["topk_group"]
    scores = 1.0 / (1.0 + np.exp(-(x @ w[f"{prefix}.gate.weight"].T)))
    choice = scores + w[f"{prefix}.gate.e_score_correction_bias"]
    out = np.zeros_like(x)
    for s in range(x.shape[0]):
        c = choice[s].copy()
        if n_group > 1:
            groups = c.reshape(n_group, -1)
            group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
            keep = np.argsort(-group_score)[:topk_group]
            mask = np.zeros(n_group, dtype=bool)
            mask[keep] = True
            c = np.where(np.repeat(mask, experts // n_group), c, 0.0)
        chosen = np.argsort(-c)[:top_k]
        weights = scores[s, chosen]
        if cfg.get("norm_topk_prob", True):
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * cfg["routed_scaling_factor"]
        for e, g in zip(chosen, weights, strict=True):
            out[s] += g * swiglu(w, f"{prefix}.experts.{e}", x[s])
    return out + swiglu(w, f"{prefix}.shared_experts", x)


def dsa_selection(
    w: Weights, prefix: str, x: np.ndarray, qr: np.ndarray, pos: np.ndarray, cfg: dict[str, Any]
) -> np.ndarray | None:
    """The DSA indexer's choice [S, S] of keys per query, or None while every key fits."""
    s, top_k = x.shape[0], cfg["index_topk"]
    if s <= top_k:
        return None
    heads, dim, rope_dim = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
    base, scaling = rope_settings(cfg)
    freqs = rope_frequencies(rope_dim, base, scaling)
    interleaved = cfg.get("indexer_rope_interleave", cfg.get("rope_parameters") is not None)
    q = linear(w, f"{prefix}.wq_b", qr).reshape(s, heads, dim).transpose(1, 0, 2)
    k = layer_norm(
        linear(w, f"{prefix}.wk", x), w[f"{prefix}.k_norm.weight"], w[f"{prefix}.k_norm.bias"]
    )
    q[..., :rope_dim] = rope(q[..., :rope_dim], pos, freqs, interleaved)
    k[..., :rope_dim] = rope(k[..., :rope_dim], pos, freqs, interleaved)
    gates = linear(w, f"{prefix}.weights_proj", x) * heads**-0.5 * dim**-0.5  # [S, heads]
    scores = np.einsum("hsd,td->hst", q, k)
    scores = (np.maximum(scores, 0) * gates.T[:, :, None]).sum(0)
    causal = pos[:, None] >= pos[None, :]
    scores = np.where(causal, scores, -np.inf)
    chosen = np.zeros((s, s), dtype=bool)
    for row in range(s):
        chosen[row, np.argsort(-scores[row], kind="stable")[:top_k]] = True
    return chosen & causal


def mla_attention(w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """Multi-head latent attention over S positions from 0, causal (plus DSA when present)."""
    s = x.shape[0]
    heads, nope, rope_dim = (
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
    )
    v_dim, kv_rank, eps = cfg["v_head_dim"], cfg["kv_lora_rank"], cfg["rms_norm_eps"]
    base, scaling = rope_settings(cfg)
    pos = np.arange(s, dtype=np.float64)
    # The latent norms' eps is 1e-6 in transformers and mlx-lm's DeepSeek, the config's in
    # vLLM; at these sizes the two differ far below the tests' tolerance.
    lat_eps = eps
    qr = rms_norm(linear(w, f"{prefix}.q_a_proj", x), w[f"{prefix}.q_a_layernorm.weight"], lat_eps)
    # LongCat scales the latents by sqrt(hidden / rank) (vLLM folds it into the norm weights).
    hidden = cfg["hidden_size"]
    q_scale = (hidden / cfg["q_lora_rank"]) ** 0.5 if cfg.get("mla_scale_q_lora") else 1.0
    kv_scale = (hidden / kv_rank) ** 0.5 if cfg.get("mla_scale_kv_lora") else 1.0
    q = linear(w, f"{prefix}.q_b_proj", qr * q_scale)
    q = q.reshape(s, heads, nope + rope_dim).transpose(1, 0, 2)
    ckv = linear(w, f"{prefix}.kv_a_proj_with_mqa", x)
    latent = rms_norm(ckv[:, :kv_rank], w[f"{prefix}.kv_a_layernorm.weight"], lat_eps) * kv_scale
    kv = linear(w, f"{prefix}.kv_b_proj", latent).reshape(s, heads, nope + v_dim).transpose(1, 0, 2)
    freqs = rope_frequencies(rope_dim, base, scaling)
    q_pe = rope(q[..., nope:], pos, freqs, interleaved=True)
    k_pe = rope(ckv[None, :, kv_rank:], pos, freqs, interleaved=True)
    scale = (nope + rope_dim) ** -0.5
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    scores = (
        np.einsum("hsd,htd->hst", q[..., :nope], kv[..., :nope]) + q_pe @ k_pe.transpose(0, 2, 1)
    ) * scale
    allowed = np.tril(np.ones((s, s), dtype=bool))
    if f"{prefix}.indexer.wk.weight" in w:
        chosen = dsa_selection(w, f"{prefix}.indexer", x, qr, pos, cfg)
        allowed = allowed if chosen is None else chosen
    probs = softmax(np.where(allowed, scores, -np.inf))
    out = (probs @ kv[..., nope:]).transpose(1, 0, 2).reshape(s, heads * v_dim)
    return linear(w, f"{prefix}.o_proj", out)


def deepseek_layer(
    w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any], index: int
) -> np.ndarray:
    eps = cfg["rms_norm_eps"]
    h = x + mla_attention(
        w, f"{prefix}.self_attn", rms_norm(x, w[f"{prefix}.input_layernorm.weight"], eps), cfg
    )
    normed = rms_norm(h, w[f"{prefix}.post_attention_layernorm.weight"], eps)
    if index < cfg["first_k_dense_replace"]:
        return h + swiglu(w, f"{prefix}.mlp", normed)
    return h + noaux_tc_moe(w, f"{prefix}.mlp", normed, cfg)


# --------------------------------------------------------------------------- MTP steps


def nextn_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, next_tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """DeepSeek-style nextn step (vLLM `DeepSeekMultiTokenPredictorLayer`) over S positions:
    logits [S, V] for t_{k+2} from h_k [S, H] and t_{k+1} [S], the layer's cache empty."""
    eps, index = cfg["rms_norm_eps"], cfg["num_hidden_layers"] + layer
    p = f"model.layers.{index}"
    e = rms_norm(w["model.embed_tokens.weight"][next_tokens], w[f"{p}.enorm.weight"], eps)
    h = rms_norm(hidden, w[f"{p}.hnorm.weight"], eps)
    x = linear(w, f"{p}.eh_proj", np.concatenate([e, h], axis=-1))
    x = deepseek_layer(w, p, x, cfg, index)
    return rms_norm(x, w[f"{p}.shared_head.norm.weight"], eps) @ w["lm_head.weight"].T


def longcat_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, next_tokens: np.ndarray
) -> np.ndarray:
    """LongCat-Flash's MTP step (vLLM `LongCatMultiTokenPredictorLayer`): enorm/hnorm,
    eh_proj, an MLA + dense-MLP block, `model.mtp.norm`, the shared lm_head."""
    eps, p = cfg["rms_norm_eps"], "model.mtp.layers.0"
    e = rms_norm(w["model.mtp.embed_tokens.weight"][next_tokens], w[f"{p}.enorm.m.weight"], eps)
    h = rms_norm(hidden, w[f"{p}.hnorm.m.weight"], eps)
    x = linear(w, f"{p}.eh_proj", np.concatenate([e, h], axis=-1))
    attn_in = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
    x = x + mla_attention(w, f"{p}.self_attn", attn_in, cfg)
    mlp_in = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    x = x + swiglu(w, f"{p}.transformer_layer.mlp", mlp_in)
    return rms_norm(x, w["model.mtp.norm.weight"], eps) @ w["lm_head.weight"].T
