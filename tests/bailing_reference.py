"""Float32 numpy forward of the Bailing MTP step (Ling-3 `bailing_moe_v3`, Ling-2.5/2.6
`bailing_hybrid`), written from vLLM's equations, independent of mlx-lm and mtpkit.

vLLM `bailing_moe_v3_mtp.py` / `bailing_moe_mtp.py` (`...MultiTokenPredictorLayer.forward`):

    x = eh_proj(concat(enorm(embed(t_{k+1})), hnorm(h_k)))
    x = x + attn(input_layernorm(x));  x = x + moe(post_attention_layernorm(x))
    logits = lm_head(final_layernorm(x))

with the MLA attention of `BailingMoeV3MLAAttention` / `BailingMoeV25MLAAttention` (q/kv
LoRA, interleaved rotary on the rope part, scale (nope + rope)^-1/2, Ling-3's head-wise
sigmoid gate `g_proj` on each head's output, output projection `dense`) and the sigmoid
router of `BailingMoeV3MoE` / `BailingMoeV25` (bias-corrected, group-limited top-k: the two
best experts of each group score it, weights from the uncorrected scores, renormalized and
scaled by routed_scaling_factor, plus the shared experts).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.mtp_reference import (
    Weights,
    linear,
    rms_norm,
    rope,
    rope_frequencies,
    softmax,
    swiglu,
)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def bailing_mla(w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """MLA over S positions from 0, causal; a `g_proj` (Ling-3) gates each head's output."""
    s, heads = x.shape[0], cfg["num_attention_heads"]
    nope, rope_dim, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_rank, eps = cfg["kv_lora_rank"], cfg["rms_norm_eps"]
    pos = np.arange(s, dtype=np.float64)
    qr = rms_norm(linear(w, f"{prefix}.q_a_proj", x), w[f"{prefix}.q_a_layernorm.weight"], eps)
    q = linear(w, f"{prefix}.q_b_proj", qr).reshape(s, heads, nope + rope_dim).transpose(1, 0, 2)
    ckv = linear(w, f"{prefix}.kv_a_proj_with_mqa", x)
    latent = rms_norm(ckv[:, :kv_rank], w[f"{prefix}.kv_a_layernorm.weight"], eps)
    kv = linear(w, f"{prefix}.kv_b_proj", latent).reshape(s, heads, nope + v_dim).transpose(1, 0, 2)
    freqs = rope_frequencies(rope_dim, float(cfg["rope_theta"]), cfg.get("rope_scaling"))
    q_pe = rope(q[..., nope:], pos, freqs, interleaved=True)
    k_pe = rope(ckv[None, :, kv_rank:], pos, freqs, interleaved=True)
    scores = np.einsum("hsd,htd->hst", q[..., :nope], kv[..., :nope]) + q_pe @ k_pe.transpose(
        0, 2, 1
    )
    scores = scores * (nope + rope_dim) ** -0.5
    causal = np.tril(np.ones((s, s), dtype=bool))
    out = (softmax(np.where(causal, scores, -np.inf)) @ kv[..., nope:]).transpose(1, 0, 2)
    if f"{prefix}.g_proj.weight" in w:
        out = out * sigmoid(linear(w, f"{prefix}.g_proj", x))[..., None]
    return linear(w, f"{prefix}.dense", out.reshape(s, heads * v_dim))


def bailing_moe(w: Weights, prefix: str, x: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    n_group, topk_group = cfg["n_group"], cfg["topk_group"]
    scores = sigmoid(x @ w[f"{prefix}.gate.weight"].T)
    choice = scores + w[f"{prefix}.gate.expert_bias"]
    out = np.zeros_like(x)
    for s in range(x.shape[0]):
        groups = choice[s].reshape(n_group, -1)
        group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        kept = np.zeros(n_group, dtype=bool)
        kept[np.argsort(-group_score, kind="stable")[:topk_group]] = True
        c = np.where(np.repeat(kept, experts // n_group), choice[s], -np.inf)
        chosen = np.argsort(-c, kind="stable")[:top_k]
        weights = scores[s, chosen] / (scores[s, chosen].sum() + 1e-20)
        for e, g in zip(chosen, weights * cfg["routed_scaling_factor"], strict=True):
            out[s] += g * swiglu(w, f"{prefix}.experts.{e}", x[s])
    return out + swiglu(w, f"{prefix}.shared_experts", x)


def bailing_mtp_logits(
    w: Weights, cfg: dict[str, Any], hidden: np.ndarray, next_tokens: np.ndarray, layer: int = 0
) -> np.ndarray:
    """Logits [S, V] for t_{k+2} from h_k [S, H] and t_{k+1} [S], the layer's cache empty."""
    eps, p = cfg["rms_norm_eps"], f"model.layers.{cfg['num_hidden_layers'] + layer}"
    e = rms_norm(w["model.word_embeddings.weight"][next_tokens], w[f"{p}.enorm.weight"], eps)
    h = rms_norm(hidden, w[f"{p}.hnorm.weight"], eps)
    x = linear(w, f"{p}.eh_proj", np.concatenate([e, h], axis=-1))
    attn_in = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
    x = x + bailing_mla(w, f"{p}.attention", attn_in, cfg)
    mlp_in = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    x = x + bailing_moe(w, f"{p}.mlp", mlp_in, cfg)
    return rms_norm(x, w[f"{p}.final_layernorm.weight"], eps) @ w["lm_head.weight"].T
