"""An independent float32 numpy EAGLE-3 drafter and speculative loop, as the EAGLE repo's
`cnets.py` (`Model.forward`, `LlamaDecoderLayeremb`, `topK_genrate` with one branch) and
vLLM's `llama_eagle3.py` define them, with no cache: every draft step recomputes the drafter
over all its inputs afresh. The target's layer inputs come from stock mlx-lm's own decoder
layers run over the whole sequence (`mlx_lm.load`, a causal mask), not from mtpkit's tap.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from tests.dflash_reference import StockTarget, _np, rms_norm


def inverse_frequencies(d: int, theta: float, scaling: dict | None) -> np.ndarray:
    """transformers' RoPE inverse frequencies, Llama 3.1's `llama3` scaling included
    (`_compute_llama3_parameters`)."""
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled)


def rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [heads, T, D] at `positions` [T] with inverse frequencies `inv`."""
    d = x.shape[-1]
    angles = positions[:, None].astype(np.float64) * inv[None]
    cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
    sin = np.concatenate([np.sin(angles)] * 2, -1).astype(np.float32)
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class StockInputs(StockTarget):
    """Stock mlx-lm's target, read as EAGLE's `all_hidden_states`: the inputs of layers."""

    def layer_inputs(self, tokens: list[int], ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(the inputs of layers `ids` [T, 3H], concatenated; greedy next token after each [T])."""
        inner = self.model.model
        h = inner.embed_tokens(mx.array(tokens)[None])
        inputs = []
        for layer in inner.layers:
            inputs.append(h)
            h = layer(h, "causal" if len(tokens) > 1 else None, None)
        inputs.append(h)  # "layer N"'s input: the last layer's output, before the norm
        logits = self.model.lm_head(inner.norm(h))
        features = np.concatenate([_np(inputs[i][0]) for i in ids], axis=-1)
        return features, np.array(mx.argmax(logits[0], axis=-1))

    @property
    def layers(self) -> int:
        return len(self.model.model.layers)


class ReferenceEagle3:
    """The drafter of a directory, in numpy float32 (its published tensor names read here)."""

    def __init__(self, path: Path, target: StockInputs) -> None:
        c = json.loads((Path(path) / "config.json").read_text())
        if "transformer_layer_config" in c:  # vLLM speculators: norm_before_residual true then
            c = {**c["transformer_layer_config"], "norm_before_residual": True, **c}
        self.config = c
        raw = {}
        for shard in sorted(Path(path).glob("*.safetensors")):
            raw.update(mx.load(str(shard)))
        self.w = {}
        for k, v in raw.items():
            k = k.removeprefix("model.").replace("layers.0.", "midlayer.")
            self.w[k] = np.array(v) if k in ("d2t", "t2d") else _np(v)
        self.eps = c["rms_norm_eps"]
        self.heads, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.d = c.get("head_dim") or c["hidden_size"] // self.heads
        self.inv = inverse_frequencies(self.d, c.get("rope_theta", 10000.0), c.get("rope_scaling"))
        n = target.layers
        self.ids = c.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
        self.before = c.get("norm_before_residual", False)
        self.target = target
        draft = self.w["lm_head.weight"].shape[0]
        self.to_target = np.arange(draft) + self.w.get("d2t", np.zeros(draft, np.int64))

    def _layer(self, embeds: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """`LlamaDecoderLayeremb` over inputs at positions 0 .. T-1, causal."""
        w = {k.removeprefix("midlayer."): v for k, v in self.w.items() if k.startswith("midlayer.")}
        T, d = hidden.shape[0], self.d
        normed = rms_norm(hidden, w["hidden_norm.weight"], self.eps)
        residual = normed if self.before else hidden
        x = np.concatenate([rms_norm(embeds, w["input_layernorm.weight"], self.eps), normed], -1)
        pos = np.arange(T)
        q = (x @ w["self_attn.q_proj.weight"].T).reshape(T, self.heads, d).transpose(1, 0, 2)
        k = (x @ w["self_attn.k_proj.weight"].T).reshape(T, self.kv, d).transpose(1, 0, 2)
        v = (x @ w["self_attn.v_proj.weight"].T).reshape(T, self.kv, d).transpose(1, 0, 2)
        q, k = rope(q, pos, self.inv), rope(k, pos, self.inv)
        group = self.heads // self.kv
        k, v = np.repeat(k, group, 0), np.repeat(v, group, 0)
        scores = q @ k.transpose(0, 2, 1) * d**-0.5
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        h = residual + attn.transpose(1, 0, 2).reshape(T, -1) @ w["self_attn.o_proj.weight"].T
        hn = rms_norm(h, w["post_attention_layernorm.weight"], self.eps)
        gate = hn @ w["mlp.gate_proj.weight"].T
        act = gate / (1 + np.exp(-gate)) * (hn @ w["mlp.up_proj.weight"].T)
        return h + act @ w["mlp.down_proj.weight"].T

    def logits(self, tokens: list[int], depth: int, forced: list[int] | None = None) -> np.ndarray:
        """[depth, V_d]: the draft-vocabulary logits of each step after confirmed `tokens`
        (the last not yet computed by the target); step k+1 is fed step k's greedy draft,
        or `forced[k]` when given."""
        features, _ = self.target.layer_inputs(tokens[:-1], self.ids)
        hidden = features @ self.w["fc.weight"].T  # pair p: (g_p, tokens[p + 1])
        inputs = list(tokens[1:])
        out = []
        for k in range(depth):
            h = self._layer(self.target.embed[inputs], hidden)
            logits = rms_norm(h[-1], self.w["norm.weight"], self.eps) @ self.w["lm_head.weight"].T
            out.append(logits)
            token = forced[k] if forced is not None else int(self.to_target[logits.argmax()])
            hidden = np.concatenate([hidden, h[-1:]], 0)  # its own output feeds the next step
            inputs.append(token)
        return np.stack(out)

    def drafts(self, tokens: list[int], depth: int) -> list[int]:
        """The greedy drafts after confirmed `tokens`, as target ids."""
        return [int(self.to_target[i]) for i in self.logits(tokens, depth).argmax(-1)]

    def dists(self, tokens: list[int], drafts: list[int]) -> np.ndarray:
        """[K, V]: each draft's distribution at temperature 1 over the target vocabulary,
        the drafter fed `drafts` (zero outside the draft vocabulary)."""
        logits = self.logits(tokens, len(drafts), forced=drafts)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        full = np.zeros((len(drafts), self.target.embed.shape[0]))
        full[:, self.to_target] = p / p.sum(-1, keepdims=True)
        return full


def reference_loop(draft: ReferenceEagle3, prompt: list[int], depth: int,
                   n: int) -> tuple[list[int], list[int]]:  # fmt: skip
    """EAGLE's loop at greedy with one branch, mtpkit's round boundary (the prompt's last
    token starts the first round): (tokens, drafts accepted per round)."""
    tokens, accepted = list(prompt), []
    while len(tokens) - len(prompt) < n:
        drafts = draft.drafts(tokens, depth)
        _, greedy = draft.target.layer_inputs(tokens + drafts, draft.ids)
        posterior = [int(t) for t in greedy[len(tokens) - 1 :]]
        pairs = zip(drafts, posterior[:depth], strict=True)
        kept = next((i for i, (a, b) in enumerate(pairs) if a != b), depth)
        tokens += drafts[:kept] + [posterior[kept]]
        accepted.append(kept)
    return tokens[len(prompt) : len(prompt) + n], accepted
