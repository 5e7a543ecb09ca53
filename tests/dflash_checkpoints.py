"""Tiny DFlash drafters in z-lab's published on-disk format, for a target of
`tests.checkpoints.build_dense_model`.

config.json as z-lab's Qwen3-8B-DFlash-b16 has it (Qwen3 fields, `architectures:
["DFlashDraftModel"]`, `auto_map` to its remote code, `block_size`, `num_target_layers`,
`dflash_config: {mask_token_id, target_layer_ids}`) and one bf16 `model.safetensors` whose
names are the remote-code module's (`fc.weight`, `hidden_norm.weight`, `layers.N.*`,
`norm.weight`): no embedding and no output head, those are the target's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

LAYER_SHAPES = {  # name -> shape, in units of (hidden H, heads*head_dim Q, kv*head_dim KV, I)
    "input_layernorm.weight": ("H",),
    "post_attention_layernorm.weight": ("H",),
    "self_attn.q_proj.weight": ("Q", "H"),
    "self_attn.k_proj.weight": ("KV", "H"),
    "self_attn.v_proj.weight": ("KV", "H"),
    "self_attn.o_proj.weight": ("H", "Q"),
    "self_attn.q_norm.weight": ("D",),
    "self_attn.k_norm.weight": ("D",),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}


def dflash_config(target: dict[str, Any], *, layers: int, target_layer_ids: list[int],
                  block_size: int, mask_token_id: int) -> dict[str, Any]:  # fmt: skip
    hidden = int(target["hidden_size"])
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": 2048,
        "max_window_layers": layers,
        "num_attention_heads": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "num_target_layers": int(target["num_hidden_layers"]),
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(target["vocab_size"]),
    }


def build_dflash(path: Path, target: Path, *, layers: int = 2, target_layer_ids: list[int]
                 | None = None, block_size: int = 8, mask_token_id: int = 5, seed: int = 7,
                 extra: dict[str, mx.array] | None = None) -> Path:  # fmt: skip
    """A drafter for the target directory `target`, random bf16 weights of `seed`."""
    target_config = json.loads((Path(target) / "config.json").read_text())
    ids = target_layer_ids if target_layer_ids is not None else [0, 2]
    config = dflash_config(target_config, layers=layers, target_layer_ids=ids,
                           block_size=block_size, mask_token_id=mask_token_id)  # fmt: skip
    h, d = config["hidden_size"], config["head_dim"]
    units = {"H": h, "D": d, "I": config["intermediate_size"],
             "Q": config["num_attention_heads"] * d, "KV": config["num_key_value_heads"] * d}  # fmt: skip
    mx.random.seed(seed)

    def tensor(shape: tuple[str, ...]) -> mx.array:
        dims = [units[u] for u in shape]
        if len(dims) == 1:  # norms: near one, as trained ones are
            return (1.0 + 0.1 * mx.random.normal(dims)).astype(mx.bfloat16)
        return (mx.random.normal(dims) * dims[1] ** -0.5).astype(mx.bfloat16)

    weights = {
        "fc.weight": (mx.random.normal((h, h * len(ids))) * (h * len(ids)) ** -0.5).astype(
            mx.bfloat16
        ),
        "hidden_norm.weight": tensor(("H",)),
        "norm.weight": tensor(("H",)),
    }
    for i in range(layers):
        for name, shape in LAYER_SHAPES.items():
            weights[f"layers.{i}.{name}"] = tensor(shape)
    weights.update(extra or {})
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def fit_dflash(draft: Path, target: Path, tokens: list[int], start: int, *, steps: int = 60,
               depth: int = 4) -> None:  # fmt: skip
    """Train the drafter in `draft` (in place, bf16 again) to predict the target's greedy
    `tokens` from every position after `start`: a drafter whose drafts the target keeps,
    so that acceptance is worth comparing. The weights are only a fixture: the tests hold
    the drafter to `tests.dflash_reference`, whatever its weights."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from mtpkit.runtime.dflash import load_dflash
    from tests.dflash_reference import StockTarget

    stock = StockTarget(target)
    d = load_dflash(draft)
    ids = list(d.layout.target_layer_ids)
    features, _ = stock.layer_outputs(tokens, ids)
    features = mx.array(features)[None]
    embed, head = stock.model.model.embed_tokens, stock.model.lm_head
    mask = d.layout.mask_token_id
    model = d.model
    model.set_dtype(mx.float32)
    model.train()
    examples = [t for t in range(start, len(tokens) - depth)]

    def loss_fn(model: nn.Module) -> mx.array:
        total = mx.array(0.0)
        for t in examples:
            block = embed(mx.array([[tokens[t]] + [mask] * depth]))
            h = model(block, features[:, :t], model.make_cache())
            logits = head(h[:, 1:])
            labels = mx.array([tokens[t + 1 : t + 1 + depth]])
            total = total + nn.losses.cross_entropy(logits, labels).mean()
        return total / len(examples)

    optimizer = optim.Adam(learning_rate=3e-2)
    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        _, grads = step(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(Path(draft) / "model.safetensors"), weights, metadata={"format": "pt"})
