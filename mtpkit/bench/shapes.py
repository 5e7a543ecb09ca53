"""Random-weight models of real shapes, for speed measurements that need size, not skill.

`SHAPES` holds text configs of Qwen3.5 checkpoints (the fields mlx-lm's `qwen3_5` model
reads). Not checked against the published configs (no Hub here): the 4b intermediate size and
head counts, the 9b intermediate size (12288) and untied lm_head, and the 35B-A3B's 256
experts x 512, top-8, came from third-party configs. `build_random_model` writes one as an
mlx-lm directory, quantized,
with an MTP sidecar of the same shape, that stock `mlx_lm.load` and `mtpkit` both load.

Beside them two Qwen3 dense shapes (mlx-lm's `qwen3`), from memory of the published configs
of Qwen/Qwen3-4B and Qwen/Qwen3-8B, unchecked here: 36 layers, 32 heads, 8 KV heads of 128,
vocabulary 151936, rope_theta 1e6; 4b hidden 2560, intermediate 9728, tied embeddings; 8b
hidden 4096, intermediate 12288, a separate lm_head. They ship no MTP head: `random_model_dir`
gives them a random DFlash drafter of the published shape instead (`random_drafter`).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError

# Shared by every Qwen3.5 text config: 3 gated-delta-net layers to 1 full-attention layer,
# head_dim 256 with a quarter of it rotary, interleaved mrope, a 248k vocabulary.
_QWEN3_5_COMMON: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
}

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3.5-0.8B: hidden 1024, 24 layers, tied embeddings.
    "qwen3_5-0.8b": _QWEN3_5_COMMON
    | {
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "tie_word_embeddings": True,
    },
    # Qwen3.5-4B: hidden 2560, 32 layers, tied embeddings.
    "qwen3_5-4b": _QWEN3_5_COMMON
    | {
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "tie_word_embeddings": True,
    },
    # Qwen3.5-9B: hidden 4096, 32 layers, separate lm_head.
    "qwen3_5-9b": _QWEN3_5_COMMON
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "tie_word_embeddings": False,
    },
    # Qwen3.5-35B-A3B's layer (256 experts of 512, 8 routed + 1 shared, hidden 2048) with 8
    # of its 40 layers: the per-token cost of a layer, at a size that builds in minutes.
    "qwen3_5_moe-35b-a3b-8l": _QWEN3_5_COMMON
    | {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
}
# Qwen3 dense (mlx-lm's `qwen3`): no MTP head; drafted by a block drafter (`random_drafter`).
_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
}
SHAPES |= {
    # Qwen3-4B: hidden 2560, tied embeddings.
    "qwen3-4b": _QWEN3_COMMON
    | {"hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    # Qwen3-8B: hidden 4096, separate lm_head.
    "qwen3-8b": _QWEN3_COMMON
    | {"hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
}
DTYPES = ("float32", "bfloat16")


def has_head(shape: str) -> bool:
    """Whether the shape's random model has an MTP head (else a random block drafter)."""
    return "mtp_num_hidden_layers" in SHAPES[shape]


def shape_config(shape: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model config (`model_type` + `text_config`) of `shape`, with `overrides` applied
    to its text config (e.g. fewer layers or a smaller hidden size for a quick test)."""
    if shape not in SHAPES:
        raise MtpkitError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    text = dict(SHAPES[shape]) | (overrides or {})
    if not has_head(shape):  # a dense Qwen3: one flat config
        return text
    moe = text["model_type"] == "qwen3_5_moe_text"
    return {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


def build_random_model(
    shape: str,
    out: Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    dtype: str = "float32",
    tokenizer_from: Path | None = None,
    overrides: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    draft_vocab: int | None = None,
) -> Path:
    """Write a random-weight mlx-lm directory of `shape`, quantized, with an MTP sidecar
    (drafting over the first `draft_vocab` token ids when given, as `convert --draft-vocab`
    without a corpus chooses them) where the shape has a head.

    `dtype` is that of the quantization scales and the unquantized weights. On Linux's CPU
    backend float32 scales multiply about ten times faster than bfloat16 ones; on a GPU
    bfloat16 is what published 4-bit checkpoints carry.
    """
    import importlib

    from mlx_lm.utils import quantize_model, save_config, save_model

    say = progress or (lambda line: None)
    config = shape_config(shape, overrides)
    if draft_vocab is not None and not has_head(shape):
        raise MtpkitError(
            f"--draft-vocab subsets an MTP head's vocabulary; {shape} has no head (a random "
            "DFlash drafter drafts through the target's): drop --draft-vocab"
        )
    layers = (config.get("text_config") or config)["num_hidden_layers"]
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    say(f"building a random {shape} model ({layers} layers, {dtype} scales): random weights")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    scale_init(model, getattr(mx, dtype))
    say(f"quantizing the random model to {bits} bits")
    predicate = getattr(model, "quant_predicate", None)
    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm's "[INFO] Quantized" line
        model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    say(f"writing the random model to {out}")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    del model
    if has_head(shape):
        _write_head(config, out, shape, bits, group_size, getattr(mx, dtype))
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix in (".jinja",):
                shutil.copy(f, out / f.name)
    if draft_vocab is not None:
        _add_draft_vocab(out, draft_vocab, config)
    return out


def _add_draft_vocab(out: Path, size: int, config: dict[str, Any]) -> None:
    """The head's draft vocabulary, recorded in its manifest as convert records it."""
    from mtpkit.convert.draft_vocab import write_draft_vocab

    text = config.get("text_config") or config
    manifest_path = out / "mtp" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["draft_vocab"] = write_draft_vocab(out, size, (), int(text["vocab_size"]))
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")


def _write_head(
    config: dict[str, Any], out: Path, shape: str, bits: int, group_size: int, dtype: mx.Dtype
) -> None:
    """The MTP sidecar: a random head of the config's family, quantized like the backbone."""
    from mlx.utils import tree_flatten

    from mtpkit.runtime.headload import build_head

    head = build_head(config, 1)
    scale_init(head, dtype)
    nn.quantize(head, group_size=group_size, bits=bits)
    (out / "mtp").mkdir(exist_ok=True)
    weights = {f"language_model.mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(
        str(out / "mtp" / "weights.safetensors"), weights, metadata={"format": "mlx"}
    )
    manifest = {
        "format": "mtpkit",
        "family": config["model_type"],
        "prefix": "language_model.mtp.",
        "num_layers": 1,
        "rmsnorm_weight_format": "mlx_gamma",
        "hidden": "post_norm",
        "concat_order": "embedding_first",
        "mtp_quantization": {"bits": bits, "group_size": group_size},
        "note": f"random weights of shape {shape}, built by mtpkit bench",
    }
    (out / "mtp" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def scale_init(module: nn.Module, dtype: mx.Dtype) -> None:
    """Small random weights (A_log stays float32, as mlx-lm keeps it), so activations stay
    finite through a deep random stack."""
    from mlx.utils import tree_flatten, tree_unflatten

    params = []
    for k, v in tree_flatten(module.parameters()):
        if v.ndim >= 2 and "conv1d" not in k:
            v = mx.random.normal(v.shape, dtype=dtype) * 0.02
        params.append((k, v if k.endswith("A_log") else v.astype(dtype)))
        mx.eval(params[-1][1])
    module.update(tree_unflatten(params))


def random_model_dir(
    shape: str,
    dtype: str = "float32",
    *,
    layers: int | None = None,
    progress: Callable[[str], None] | None = None,
    draft_vocab: int | None = None,
) -> Path:
    """A temporary directory holding a random model of `shape` (the caller removes its
    parent), beside it a random DFlash drafter for a shape without a head
    (`random_drafter.drafter_beside`); `layers` builds only that many layers (same widths),
    for a quicker build; `draft_vocab`: the head drafts over that many ids.
    Interrupted while building (Ctrl-C, SIGTERM), it removes what it built; the directories
    of runs killed outright are removed by the next run."""
    from importlib.resources import files

    from mtpkit.bench.random_drafter import build_random_dflash, drafter_beside
    from mtpkit.convert.destination import remove_stale_work_dirs, work_dir_prefix

    shape_config(shape)  # an unknown shape is a one-line error
    overrides = {"num_hidden_layers": layers} if layers else None
    root = Path(tempfile.gettempdir())
    remove_stale_work_dirs(root, "mtpkit-bench")
    tmp = Path(tempfile.mkdtemp(prefix=f"{work_dir_prefix('mtpkit-bench')}{shape}-", dir=root))
    tok = Path(str(files("mtpkit") / "examples" / "tiny-qwen3_5"))
    try:
        built = build_random_model(
            shape,
            tmp / shape,
            dtype=dtype,
            tokenizer_from=tok,
            overrides=overrides,
            progress=progress,
            draft_vocab=draft_vocab,
        )
        if not has_head(shape):
            build_random_dflash(built, drafter_beside(built), dtype=dtype, progress=progress)
        return built
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
