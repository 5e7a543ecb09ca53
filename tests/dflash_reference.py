"""An independent float32 numpy DFlash drafter and speculative loop, as z-lab's
transformers code defines them (`dflash/model.py`: `DFlashDraftModel.forward`,
`Qwen3DFlashAttention`, `dflash_generate`), with no cache: each block is computed from the
whole context afresh. The target's layer outputs come from stock mlx-lm's own layers run
over the whole sequence (`mlx_lm.load`, its decoder layers with a causal mask), not from
mtpkit's tap.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """transformers' rotate-half RoPE of x [heads, T, D] at `positions` [T]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions[:, None].astype(np.float64) * inv[None]
    cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
    sin = np.concatenate([np.sin(angles)] * 2, -1).astype(np.float32)
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class StockTarget:
    """Stock mlx-lm's target: its layers' outputs and greedy tokens over a whole sequence."""

    def __init__(self, path: Path) -> None:
        self.model, _ = mlx_lm.load(str(path))
        self.embed = _np(self.model.model.embed_tokens.weight)
        self.head = _np(self.model.lm_head.weight)

    def layer_outputs(self, tokens: list[int], ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(features [T, n*H] of layers `ids`, greedy next token after each [T])."""
        inner = self.model.model
        h = inner.embed_tokens(mx.array(tokens)[None])
        outs = []
        for layer in inner.layers:
            h = layer(h, "causal" if len(tokens) > 1 else None, None)
            outs.append(h)
        logits = self.model.lm_head(inner.norm(h))
        features = np.concatenate([_np(outs[i][0]) for i in ids], axis=-1)
        return features, np.array(mx.argmax(logits[0], axis=-1))


class ReferenceDFlash:
    """The drafter of a directory, in numpy float32."""

    def __init__(self, path: Path) -> None:
        self.config = json.loads((Path(path) / "config.json").read_text())
        self.w = {k: _np(v) for k, v in mx.load(str(Path(path) / "model.safetensors")).items()}
        c = self.config
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        self.heads, self.kv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.ids = c["dflash_config"]["target_layer_ids"]
        self.mask = c["dflash_config"]["mask_token_id"]

    def _layer(self, i: int, x: np.ndarray, ctx: np.ndarray, s: int) -> np.ndarray:
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in self.w.items() if k.startswith(f"layers.{i}.")}
        L, d = x.shape[0], self.d
        xn = rms_norm(x, w["input_layernorm.weight"], self.eps)
        q = (xn @ w["self_attn.q_proj.weight"].T).reshape(L, self.heads, d).transpose(1, 0, 2)
        q = rope(rms_norm(q, w["self_attn.q_norm.weight"], self.eps), np.arange(s, s + L), self.theta)
        both = np.concatenate([ctx, xn], 0)
        k = (both @ w["self_attn.k_proj.weight"].T).reshape(-1, self.kv, d).transpose(1, 0, 2)
        k = rope(rms_norm(k, w["self_attn.k_norm.weight"], self.eps), np.arange(s + L), self.theta)
        v = (both @ w["self_attn.v_proj.weight"].T).reshape(-1, self.kv, d).transpose(1, 0, 2)
        group = self.heads // self.kv
        k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
        scores = q @ k.transpose(0, 2, 1) * d**-0.5  # no mask: the block sees all of it
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(L, -1) @ w["self_attn.o_proj.weight"].T
        xn = rms_norm(x, w["post_attention_layernorm.weight"], self.eps)
        gate = xn @ w["mlp.gate_proj.weight"].T
        act = gate / (1 + np.exp(-gate)) * (xn @ w["mlp.up_proj.weight"].T)
        return x + act @ w["mlp.down_proj.weight"].T

    def logits(self, features: np.ndarray, last: int, depth: int, target: StockTarget) -> np.ndarray:
        """[depth, V]: the drafts' logits after context `features` [S, n*H] and `last`."""
        ctx = rms_norm(features @ self.w["fc.weight"].T, self.w["hidden_norm.weight"], self.eps)
        x = target.embed[[last] + [self.mask] * depth]
        for i in range(self.config["num_hidden_layers"]):
            x = self._layer(i, x, ctx, features.shape[0])
        h = rms_norm(x, self.w["norm.weight"], self.eps)
        return h[1:] @ target.head.T

    def drafts(self, tokens: list[int], depth: int, target: StockTarget) -> list[int]:
        """The drafts after confirmed `tokens` (the last not yet computed by the target)."""
        features, _ = target.layer_outputs(tokens[:-1], self.ids)
        return [int(t) for t in self.logits(features, tokens[-1], depth, target).argmax(-1)]


def reference_loop(draft: ReferenceDFlash, target: StockTarget, prompt: list[int],
                   depth: int, n: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """`dflash_generate` at greedy, with mtpkit's round boundary (the prompt's last token
    starts the first block): (tokens, drafts accepted per round)."""
    tokens, accepted = list(prompt), []
    while len(tokens) - len(prompt) < n:
        drafts = draft.drafts(tokens, depth, target)
        _, greedy = target.layer_outputs(tokens + drafts, draft.ids)
        posterior = [int(t) for t in greedy[len(tokens) - 1 :]]
        pairs = zip(drafts, posterior[:depth], strict=True)
        kept = next((i for i, (a, b) in enumerate(pairs) if a != b), depth)
        tokens += drafts[:kept] + [posterior[kept]]
        accepted.append(kept)
    return tokens[len(prompt) : len(prompt) + n], accepted
