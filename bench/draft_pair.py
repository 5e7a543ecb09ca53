"""A plain attention-only target and a small draft model of the same vocabulary, for
`mtpkit bench --draft-model` (mtpkit's draft-model row against stock mlx-lm's, same trials).

    python bench/draft_pair.py OUT [--spread S] [--bits B]
    mtpkit bench --model OUT/target --draft-model OUT/draft --depth 1 --num-draft-tokens 3 \
        --trials 7 --json

Random Llama weights in float32 (`--bits B`: quantized, float32 scales; on a Linux CPU
float32 runs fastest): a target of `TARGET_LAYERS` layers, and a draft model that is the
target's first `DRAFT_LAYERS` layers with its embedding, final norm and lm_head (a twelfth
of its weights; Qwen3-0.6B is about a thirteenth of Qwen3-8B). The target's later layers
write `SPREAD` times their random outputs into the residual stream, so the draft model's
greedy token is the target's often but not always: the smaller SPREAD, the higher the
acceptance (the default: ~0.7 of the tokens from the draft model at 3 drafts a round, on
the bench prompt; 0.04: ~0.5). Both directories carry the bundled example's tokenizer, so
the pair passes the tokenizer checks of mtpkit and stock alike.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
from importlib.resources import files
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

TARGET_LAYERS = 16
DRAFT_LAYERS = 1
SPREAD = 0.02
CONFIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 1024,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
}


def random_target(spread: float) -> tuple[object, dict]:
    from mlx_lm.models import llama

    config = CONFIG | {"num_hidden_layers": TARGET_LAYERS}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = []
    for name, value in tree_flatten(model.parameters()):
        if value.ndim >= 2:
            value = mx.random.normal(value.shape) * 0.02
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            if layer >= DRAFT_LAYERS and name.endswith(("o_proj.weight", "down_proj.weight")):
                value = value * spread  # the later layers' writes into the residual stream
        params.append((name, value))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model, config


def draft_of(target: object, config: dict) -> tuple[object, dict]:
    """The target's first DRAFT_LAYERS layers, embedding, final norm and lm_head."""
    from mlx_lm.models import llama

    config = config | {"num_hidden_layers": DRAFT_LAYERS}
    draft = llama.Model(llama.ModelArgs.from_dict(config))
    kept = [
        (name, value)
        for name, value in tree_flatten(target.parameters())
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < DRAFT_LAYERS
    ]
    draft.update(tree_unflatten(kept))
    return draft, config


def write(model: object, config: dict, out: Path, bits: int | None) -> None:
    from mlx_lm.utils import quantize_model, save_config, save_model

    if bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm's "[INFO] Quantized" line
            model, config = quantize_model(model, config, 64, bits)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    tokenizer = Path(str(files("mtpkit") / "examples" / "tiny-qwen3_5"))
    for f in tokenizer.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)


def build_pair(
    out: Path, spread: float = SPREAD, bits: int | None = None
) -> tuple[Path, Path]:
    target, config = random_target(spread)
    draft, draft_config = draft_of(target, config)
    write(draft, draft_config, out / "draft", bits)  # before the target's weights are quantized
    write(target, config, out / "target", bits)
    return out / "target", out / "draft"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--spread", type=float, default=SPREAD)
    parser.add_argument("--bits", type=int, default=None, help="quantize both (default: float32)")
    args = parser.parse_args()
    target, draft = build_pair(args.out, args.spread, args.bits)
    print(f"wrote {target} and {draft}")
