"""A random DFlash drafter of the published shape for a random dense target (`bench --random
qwen3-4b`): the Qwen3 dense shapes ship no MTP head, and what drafts for them is a block
drafter trained against them.

z-lab's Qwen3-4B-DFlash-b16 and Qwen3-8B-DFlash-b16, as third-party configs quote them
(vLLM speculators' and SGLang's DFlash tests; not checked against the Hub here): a Qwen3
decoder of the target's widths (hidden, heads, KV heads, head_dim, intermediate, vocabulary,
rope) with 5 layers, `block_size` 16 (a pass drafts up to 15), mask token 151669, reading
target layers [1, 9, 17, 25, 33] of 36 (z-lab's `build_target_layer_ids(36, 5)`). A target
built with fewer layers (`--random-layers`) keeps the five taps, scaled into its layers (some
then repeat), so the drafter's `fc` still reads five layers' features, as the published one.

It is written as `mtpkit convert -q` writes a drafter (config.json with `dflash_config`, one
model.safetensors in `DFlashModel`'s names), its linear layers quantized like the target, so
that `--draft-model` and `inspect` recognise it as any DFlash directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.families.dflash import default_target_layers

DRAFT_LAYERS = 5
BLOCK_SIZE = 16
MASK_TOKEN = 151669  # Qwen3's "<|MASK|>" as DFlash adds it (lmdeploy, SGLang quote this id)
PUBLISHED_TARGET_LAYERS = 36  # the Qwen3-4B/8B targets the published taps are for


def drafter_beside(model_dir: Path) -> Path:
    """Where `random_model_dir` writes a random model's drafter: a sibling directory."""
    return model_dir.parent / f"{model_dir.name}-dflash"


def random_drafter(model_dir: Path) -> Path | None:
    """The random drafter built beside `model_dir`, None when there is none (a shape with a
    head)."""
    path = drafter_beside(model_dir)
    return path if (path / "config.json").exists() else None


def target_layers(layers: int) -> list[int]:
    """The published taps, scaled into a target of `layers` layers."""
    published = default_target_layers(PUBLISHED_TARGET_LAYERS, DRAFT_LAYERS)
    return [min(layers - 1, i * layers // PUBLISHED_TARGET_LAYERS) for i in published]


def dflash_config(target: dict[str, Any]) -> dict[str, Any]:
    """The drafter's config.json for a Qwen3 target of config `target` (see the module's text)."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
            "max_position_embeddings")  # fmt: skip
    layers = int(target["num_hidden_layers"])
    vocab = int(target["vocab_size"])
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **{k: target[k] for k in keys},
        "num_hidden_layers": DRAFT_LAYERS,
        "block_size": BLOCK_SIZE,
        "num_target_layers": layers,
        # A target narrowed for a test has fewer ids: the mask is then its last one.
        "dflash_config": {
            "mask_token_id": min(MASK_TOKEN, vocab - 1),
            "target_layer_ids": target_layers(layers),
        },  # fmt: skip
        "tie_word_embeddings": False,
    }


def build_random_dflash(
    target_dir: Path,
    out: Path,
    *,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a random DFlash drafter for the random model in `target_dir` to `out`, quantized
    as the target is (its config's quantization block), float weights and scales in `dtype`."""
    from mlx.utils import tree_flatten

    from mtpkit.bench.shapes import scale_init
    from mtpkit.families.dflash import DFlashLayout, DFlashModel

    target = json.loads((target_dir / "config.json").read_text())
    config = dflash_config(target)
    quantization = target.get("quantization")
    say = progress or (lambda line: None)
    say(f"building a random DFlash drafter ({DRAFT_LAYERS} layers, block {BLOCK_SIZE}) "
        f"reading target layers {config['dflash_config']['target_layer_ids']}")  # fmt: skip
    mx.random.seed(1)
    model = DFlashModel(DFlashLayout.of(config, str(out)))
    scale_init(model, getattr(mx, dtype))
    if quantization is not None:
        group, bits = int(quantization["group_size"]), int(quantization["bits"])
        nn.quantize(
            model, group_size=group, bits=bits,
            class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group == 0,
        )  # fmt: skip
        config["quantization"] = {"group_size": group, "bits": bits}
    config["torch_dtype"] = dtype
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
