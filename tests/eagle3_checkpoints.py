"""Tiny EAGLE-3 drafters in their published on-disk formats, for a target of
`tests.checkpoints.build_dense_model`.

- "eagle": as SafeAILab's EAGLE3-LLaMA3.1-Instruct-8B (`architectures:
  ["LlamaForCausalLMEagle3"]`, Llama fields, `draft_vocab_size`, no layer ids: the default
  (2, N // 2, N - 3)), tensors `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` (int64), `t2d`
  (bool), no embedding.
- "speculators": as vLLM's speculators exports (RedHatAI's `*-speculator.eagle3`):
  `architectures: ["Eagle3Speculator"]`, `speculators_model_type: "eagle3"`, the layer's Llama
  fields nested in `transformer_layer_config`, `eagle_aux_hidden_state_layer_ids`, no
  `norm_before_residual` (true there by default), `layers.0.*` names and an
  `embed_tokens.weight` copy of the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

LAYER_SHAPES = {  # in units of hidden H, 2H, heads*head_dim Q, kv*head_dim KV, I
    "input_layernorm.weight": ("H",),
    "hidden_norm.weight": ("H",),
    "post_attention_layernorm.weight": ("H",),
    "self_attn.q_proj.weight": ("Q", "2H"),
    "self_attn.k_proj.weight": ("KV", "2H"),
    "self_attn.v_proj.weight": ("KV", "2H"),
    "self_attn.o_proj.weight": ("H", "Q"),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}


def eagle3_config(target: dict[str, Any], *, draft_vocab: int, style: str,
                  layer_ids: list[int] | None) -> dict[str, Any]:  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 1,
        "eos_token_id": int(target.get("eos_token_id", 2)),
        "hidden_act": "silu",
        "hidden_size": int(target["hidden_size"]),
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": int(target["vocab_size"]),
        "draft_vocab_size": draft_vocab,
    }
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    if style != "speculators":
        return config
    eagle = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "torch_dtype")
    layer = {k: v for k, v in config.items() if k not in (*eagle, "architectures")}
    layer.update(rope_theta=1000000.0, head_dim=16, architectures=["LlamaForCausalLM"])
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0.dev",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]},
        },
        "target_hidden_size": int(target["hidden_size"]),
        "transformer_layer_config": layer,
        **{k: config[k] for k in eagle if k in config},
    }


def build_eagle3(path: Path, target: Path, *, vocab_ids: list[int], style: str = "eagle",
                 layer_ids: list[int] | None = None, seed: int = 11,
                 extra: dict[str, mx.array] | None = None,
                 fields: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """A drafter for the target directory `target` over the draft vocabulary `vocab_ids`
    (target ids), random bf16 weights of `seed`; `fields`: more config.json fields."""
    target_config = json.loads((Path(target) / "config.json").read_text())
    ids = sorted(set(vocab_ids))
    config = eagle3_config(target_config, draft_vocab=len(ids), style=style, layer_ids=layer_ids)
    config.update(fields or {})
    fields = config.get("transformer_layer_config") or config
    h, heads, kv = fields["hidden_size"], fields["num_attention_heads"], fields["num_key_value_heads"]
    d = h // heads
    units = {"H": h, "2H": 2 * h, "I": fields["intermediate_size"], "Q": heads * d, "KV": kv * d}
    mx.random.seed(seed)

    def tensor(*shape: str) -> mx.array:
        dims = [units[u] for u in shape]
        if len(dims) == 1:  # norms: near one, as trained ones are
            return (1.0 + 0.1 * mx.random.normal(dims)).astype(mx.bfloat16)
        return (mx.random.normal(dims) * dims[1] ** -0.5).astype(mx.bfloat16)

    prefix = "midlayer." if style == "eagle" else "layers.0."
    weights = {prefix + name: tensor(*shape) for name, shape in LAYER_SHAPES.items()}
    weights["fc.weight"] = (mx.random.normal((h, 3 * h)) * (3 * h) ** -0.5).astype(mx.bfloat16)
    weights["norm.weight"] = tensor("H")
    weights["lm_head.weight"] = (mx.random.normal((len(ids), h)) * h**-0.5).astype(mx.bfloat16)
    t2d = np.zeros(fields["vocab_size"], bool)
    t2d[ids] = True
    weights["d2t"] = mx.array(np.array(ids, np.int64) - np.arange(len(ids)))
    weights["t2d"] = mx.array(t2d)
    if style == "speculators":  # the frozen copy of the target's embedding it trained with
        stock = mx.load(str(Path(target) / "model.safetensors"))
        weights["embed_tokens.weight"] = stock["model.embed_tokens.weight"].astype(mx.bfloat16)
    weights.update(extra or {})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def fit_eagle3(draft: Path, target: Path, tokens: list[int], start: int, *, steps: int = 30,
               depth: int = 3) -> None:  # fmt: skip
    """Train the drafter in `draft` (in place, bf16 again, its names kept) to chain the
    target's greedy `tokens` from every position after `start`: a drafter whose drafts the
    target keeps, so that acceptance is worth comparing. The weights are only a fixture: the
    tests hold the drafter to `tests.eagle3_reference`, whatever its weights."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from mtpkit.runtime.eagle3 import load_eagle3
    from tests.eagle3_reference import StockInputs

    stock = StockInputs(target)
    d = load_eagle3(draft)
    ids = list(d.layout.layer_ids(stock.layers))
    features = mx.array(stock.layer_inputs(tokens, ids)[0])[None]
    embed = stock.model.model.embed_tokens
    index = {int(t): i for i, t in enumerate(np.array(d.target_ids))}
    model = d.model
    model.set_dtype(mx.float32)
    model.train()
    examples = [t for t in range(start, len(tokens) - depth - 1)]

    def loss_fn(model: nn.Module) -> mx.array:
        total = mx.array(0.0)
        for t in examples:  # confirmed tokens 0..t: pairs 0..t-1, then `depth` steps
            cache = model.make_cache()
            x = model(embed(mx.array([tokens[1 : t + 1]])), model.fuse(features[:, :t]), cache)
            x = x[:, -1:]
            for k in range(depth):
                if k > 0:
                    x = model(embed(mx.array([[tokens[t + k]]])), x, cache)
                label = mx.array([index.get(tokens[t + k + 1], 0)])
                total = total + nn.losses.cross_entropy(model.draft_logits(x)[0], label).mean()
        return total / (len(examples) * depth)

    optimizer = optim.Adam(learning_rate=2e-2)
    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        _, grads = step(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
    saved = mx.load(str(Path(draft) / "model.safetensors"))
    names = {k.removeprefix("model.").replace("layers.0.", "midlayer."): k for k in saved}
    for k, v in tree_flatten(model.parameters()):
        saved[names[k]] = v.astype(mx.bfloat16)
    mx.save_safetensors(str(Path(draft) / "model.safetensors"), saved, metadata={"format": "pt"})
