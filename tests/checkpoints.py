"""Tiny checkpoints in the real published on-disk formats, for tests (the writer; the
per-family specs are `tests/fixtures/<family>.py`).

Every layout is written the way its family is published: real key names, real config fields,
sharded safetensors with a `model.safetensors.index.json`, a real tokenizer. Only the sizes are
tiny (hidden 64, 2-4 layers, 4 experts). Stock mlx-lm loads each raw layout's backbone, which
`tests/test_checkpoints.py` proves, so a fixture that drifts from the real format fails there
rather than silently in the tests that use it.

Weights are drawn from an RNG keyed on (seed, tensor name), never on draw order, so a
checkpoint built with `with_mtp=False` has the same backbone, bit for bit, as its MTP twin.

Formats: `docs/MTP_FORMATS.md`; key names and shapes follow mlx-lm 0.32's
`models/{qwen3_5,qwen3_5_moe,qwen3_next,deepseek_v3,glm4_moe,mimo,glm4_moe_lite,
deepseek_v32,glm_moe_dsa}.py`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tests.fixtures import RAW_DRAFTS
from tests.fixtures.tensors import ENDOFTEXT_ID, IM_END_ID

__all__ = [
    "CheckpointFactory",
    "FAMILIES",
    "MLX_LAYOUTS",
    "MOE_LAYOUTS",
    "RAW_LAYOUTS",
    "RAW_WITH_MTP",
    "TOKENIZER_SPECIAL_TOKENS",
    "add_tensor",
    "build_checkpoint",
    "build_dense_model",
    "dtype_for",
    "write_tokenizer",
]

# Layouts written in the raw Hugging Face format (what a Hub repo holds): one or more per
# family file of `tests/fixtures/`, then the head-less `stripped`.
RAW_LAYOUTS: tuple[str, ...] = tuple(
    sorted(RAW_DRAFTS, key=lambda layout: (layout == "stripped", layout))
)
# Layouts written by mlx-lm (what an `mlx-community/...` repo holds).
MLX_LAYOUTS: tuple[str, ...] = ("mlx_inline", "mlx_plain")
FAMILIES: tuple[str, ...] = RAW_LAYOUTS + MLX_LAYOUTS
# The raw layouts that carry their MTP head, one per published family format.
RAW_WITH_MTP: tuple[str, ...] = tuple(layout for layout in RAW_LAYOUTS if layout != "stripped")
# Layouts with MoE layers: MLX's CPU backend runs them in float32 only (no bf16 GatherMM).
MOE_LAYOUTS: tuple[str, ...] = (
    "qwen3_5_moe",
    "qwen3_6_moe",
    "qwen3_next",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "deepseek_v32",
    "glm_moe_dsa",
    "longcat_flash",
    "ernie4_5_moe",
    "exaone_moe",
    "mimo_v2_flash",
    "step3p5",
    "nemotron_h",
    "bailing_moe_v3",
    "bailing_hybrid",
)


# What the `checkpoint` fixture of `tests/conftest.py` is: `checkpoint(layout, **build_args)`.
CheckpointFactory = Callable[..., Path]


def dtype_for(layout: str) -> str:
    """The dtype a test builds `layout` in so that it runs on MLX's CPU backend."""
    return "float32" if layout in MOE_LAYOUTS else "bfloat16"


# Special tokens, in id order 0, 1, 2 of the fixture tokenizer.
TOKENIZER_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_DTYPES = ("bfloat16", "float16", "float32")
# Quantization of the MLX layouts, as published "-4bit" builds and mlx-lm's qwen3_5 predicate do.
_Q_GROUP_SIZE = 64
_Q_BITS = 4
_ROUTER_BITS = 8


# --------------------------------------------------------------------------- writing


def _shard_name(index: int, count: int) -> str:
    # A lone file is `model.safetensors` in both transformers' and mlx-lm's writers.
    return (
        "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    )


def _split_into_shards(
    backbone: dict[str, mx.array], mtp: dict[str, mx.array], shards: int
) -> list[dict[str, mx.array]]:
    """Backbone tensors in order over `shards` files; MTP tensors appended to the last one.

    The split depends only on the backbone, so a twin without MTP shards identically, and the
    last shard holds backbone tensors beside the MTP ones, as in the published checkpoints.
    """
    names = list(backbone)
    if len(names) < shards:
        raise ValueError(f"{len(names)} backbone tensors cannot fill {shards} shards")
    groups = [{name: backbone[name] for name in part} for part in np.array_split(names, shards)]
    groups[-1].update(mtp)
    return groups


def _write_shards(
    path: Path,
    groups: list[dict[str, mx.array]],
    *,
    file_format: str,
    extra_metadata: dict[str, Any] | None = None,
) -> None:
    """Write the shards and `model.safetensors.index.json` (weight_map sorted, as HF does)."""
    weight_map: dict[str, str] = {}
    total_size = 0
    for i, group in enumerate(groups):
        name = _shard_name(i, len(groups))
        mx.save_safetensors(str(path / name), group, metadata={"format": file_format})
        weight_map.update(dict.fromkeys(group, name))
        total_size += sum(array.nbytes for array in group.values())
    index = {
        "metadata": {"total_size": total_size, **(extra_metadata or {})},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(path / "model.safetensors.index.json", index)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _build_raw(
    layout: str,
    path: Path,
    *,
    dtype: str,
    seed: int,
    shards: int,
    with_mtp: bool,
    vocab_size: int,
) -> None:
    draft = RAW_DRAFTS[layout](seed, vocab_size, dtype)
    mx_dtype = getattr(mx, dtype)
    backbone = draft.backbone.to_mlx(mx_dtype)
    mtp = draft.mtp.to_mlx(mx_dtype) if with_mtp and layout != "stripped" else {}
    if shards == 1:
        # How transformers saves a model below its shard size: one file, no index.
        mx.save_safetensors(
            str(path / "model.safetensors"), backbone | mtp, metadata={"format": "pt"}
        )
    else:
        _write_shards(path, _split_into_shards(backbone, mtp, shards), file_format="pt")
    _write_json(path / "config.json", draft.config)
    write_tokenizer(path, vocab_size)


# --------------------------------------------------------------------------- MLX layouts

# Norms the Qwen3.5/3.6 checkpoints store zero-centred; the MLX side stores them +1.
_ZERO_CENTRED_MTP_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_PER_EXPERT_KEY = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _inline_mtp_tensors(
    raw_mtp: dict[str, mx.array], dtype: mx.Dtype
) -> tuple[dict[str, mx.array], dict[str, dict[str, int]], int]:
    """Raw Qwen3.5 MoE `mtp.*` tensors as the PR #990 builds store them.

    Returns the tensors (`language_model.mtp.*`, experts stacked into `switch_mlp`, norms
    shifted, linears quantized like the backbone), the per-path quantization overrides for the
    config, and the parameter count mlx-lm's index records.
    """
    staged: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for name, array in raw_mtp.items():
        if match := _PER_EXPERT_KEY.match(name):
            mlp, expert, proj = match.groups()
            experts.setdefault((mlp, proj), {})[int(expert)] = array
        else:
            staged[name] = array
    for (mlp, proj), by_expert in experts.items():
        staged[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack(
            [by_expert[e] for e in sorted(by_expert)]
        )

    tensors: dict[str, mx.array] = {}
    overrides: dict[str, dict[str, int]] = {}
    parameters = 0
    for name in sorted(staged):
        array = staged[name].astype(mx.float32)
        if array.ndim == 1 and name.endswith(_ZERO_CENTRED_MTP_NORMS):
            # Shift in float32, then cast: the precision note of MTP_FORMATS.md.
            array = array + 1.0
        array = array.astype(dtype)
        key = f"language_model.{name}"
        if array.ndim == 1 or not name.endswith(".weight"):
            tensors[key] = array
            parameters += array.size
            continue
        module = key.removesuffix(".weight")
        bits = _ROUTER_BITS if module.endswith(("mlp.gate", "shared_expert_gate")) else _Q_BITS
        if bits != _Q_BITS:
            overrides[module] = {"group_size": _Q_GROUP_SIZE, "bits": bits}
        weight, scales, biases = mx.quantize(array, group_size=_Q_GROUP_SIZE, bits=bits)
        tensors |= {
            f"{module}.weight": weight,
            f"{module}.scales": scales,
            f"{module}.biases": biases,
        }
        parameters += weight.size * 32 // bits
    return tensors, overrides, parameters


def _build_mlx(
    layout: str,
    path: Path,
    *,
    dtype: str,
    seed: int,
    shards: int,
    with_mtp: bool,
    vocab_size: int,
) -> None:
    """Convert a raw fixture with stock `mlx_lm.convert`, then graft the inline MTP head.

    Stock mlx-lm writes a single `model.safetensors` for a model this small; the tensors are
    re-split over `shards` files (mlx-lm's format otherwise unchanged) so the layout matches
    the multi-shard published builds.
    """
    from mlx_lm.convert import convert
    from mlx_lm.utils import save_config

    inline = layout == "mlx_inline"
    with tempfile.TemporaryDirectory(prefix="mtpkit-fixture-") as tmp:
        raw, converted = Path(tmp) / "hf", Path(tmp) / "mlx"
        # A float32 source makes mlx-lm's +1 norm shift happen in float32 before the cast.
        build_checkpoint(
            "qwen3_5_moe" if inline else "qwen3_5",
            raw,
            dtype="float32",
            seed=seed,
            shards=2,
            with_mtp=inline,
            vocab_size=vocab_size,
        )
        with contextlib.redirect_stdout(io.StringIO()):
            convert(
                str(raw),
                str(converted),
                quantize=True,
                q_group_size=_Q_GROUP_SIZE,
                q_bits=_Q_BITS,
                dtype=dtype,
            )

        config = json.loads((converted / "config.json").read_text())
        # Published builds come from bfloat16 sources; the float32 source above is only a
        # fixture device, so the copied config records the dtype the weights are stored in.
        config["text_config"]["dtype"] = dtype
        metadata = json.loads((converted / "model.safetensors.index.json").read_text())["metadata"]
        weights: dict[str, mx.array] = {}
        for shard in sorted(converted.glob("model*.safetensors")):
            weights |= mx.load(str(shard))

        mtp: dict[str, mx.array] = {}
        if inline and with_mtp:
            raw_tensors: dict[str, mx.array] = {}
            for shard in sorted(raw.glob("model*.safetensors")):
                raw_tensors |= mx.load(str(shard))
            raw_mtp = {k: v for k, v in raw_tensors.items() if k.startswith("mtp.")}
            mtp, overrides, mtp_parameters = _inline_mtp_tensors(raw_mtp, getattr(mx, dtype))
            config["quantization"] |= overrides
            metadata["total_parameters"] += mtp_parameters

        path.mkdir(parents=True, exist_ok=True)
        for item in converted.iterdir():
            if not item.name.startswith("model"):
                shutil.copy(item, path / item.name)
        _write_shards(
            path,
            _split_into_shards(weights, mtp, shards),
            file_format="mlx",
            extra_metadata={k: v for k, v in metadata.items() if k != "total_size"},
        )
        # save_config also mirrors `quantization` into `quantization_config`, as stock does.
        save_config(config, path / "config.json")


# --------------------------------------------------------------------------- public API


def build_checkpoint(
    layout: str,
    path: Path,
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    shards: int = 2,
    with_mtp: bool = True,
    vocab_size: int = 512,
) -> Path:
    """Write a tiny checkpoint of `layout` (one of FAMILIES) into `path` and return `path`.

    Raw layouts write weights in `dtype` over `shards` files plus the index (shards=1 writes a
    lone `model.safetensors`, as transformers does for small models). `with_mtp=False` writes
    the same backbone, bit for bit, without MTP tensors; the config keeps its MTP declaration.
    `stripped` never has MTP tensors, `mlx_plain` never has any either.

    MoE layouts need `dtype="float32"` to run on MLX's CPU backend (GatherMM is float32-only).
    The MLX layouts are converted from a float32 source and quantized 4-bit (group 64, routers
    8-bit); `dtype` is their non-quantized dtype (as `mlx_lm.convert --dtype`).
    """
    if layout not in FAMILIES:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(FAMILIES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    path = Path(path)
    # Leftover shards from an earlier build would be read as part of this checkpoint.
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty; build fixtures into an empty directory")
    path.mkdir(parents=True, exist_ok=True)
    build = _build_mlx if layout in MLX_LAYOUTS else _build_raw
    build(
        layout,
        path,
        dtype=dtype,
        seed=seed,
        shards=shards,
        with_mtp=with_mtp,
        vocab_size=vocab_size,
    )
    return path


def add_tensor(path: Path, shard_name: str, name: str, value: mx.array) -> None:
    """Add one tensor to a shard of a raw checkpoint and keep its index consistent."""
    shard = path / shard_name
    tensors = mx.load(str(shard))
    tensors[name] = value
    mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard_name
    index["metadata"]["total_size"] += value.nbytes
    _write_json(path / "model.safetensors.index.json", index)


def build_dense_model(
    path: Path, model_type: str = "llama", *, seed: int = 3, layers: int = 2
) -> Path:
    """A tiny dense decoder of `model_type` (llama, qwen2, qwen3: families that ship no MTP
    head) with random weights, written by stock mlx-lm's own `save_model`, and a tokenizer."""
    import importlib

    from mlx_lm.utils import save_config, save_model

    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": 512,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
    }
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    path = Path(path)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tokenizer(path, vocab_size=config["vocab_size"])
    return path


# --------------------------------------------------------------------------- tokenizer

_TOKENIZER_CORPUS = """\
Multi-token prediction trains a model to guess more than one token ahead. At inference time
the extra head drafts the next token while the backbone verifies it, so a single forward pass
can confirm two tokens instead of one. When the draft is right, generation runs faster; when it
is wrong, nothing is lost, because the backbone's own choice replaces it.
Hello world! The quick brown fox jumps over the lazy dog, and the dog does not mind at all.
Apple silicon keeps weights in unified memory, which lets the processor and the graphics cores
read the same arrays without copying them. MLX is an array framework built for that design.
A checkpoint on the Hugging Face Hub stores its tensors in safetensors files. Large models are
split into shards, and an index file maps every tensor name to the shard that holds it. The
configuration file records the model type, the hidden size, the number of layers and heads,
and the size of the vocabulary. A tokenizer turns text into numbers and numbers back into text:
byte-level byte-pair encoding starts from the 256 possible bytes and merges frequent pairs.
Questions and answers, numbers like 1, 2, 3, 10, 42 and 2026, and punctuation such as commas,
colons: semicolons; dashes - and quotes "like these" all appear in ordinary English prose.
"""


@functools.cache
def _tokenizer_json(vocab_size: int) -> str:
    """Train a byte-level BPE tokenizer once per vocab size and process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(TOKENIZER_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is below the 256 bytes plus special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TOKENIZER_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TOKENIZER_CORPUS], trainer)
    return tokenizer.to_str(pretty=True)


_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """Write a real byte-level BPE tokenizer (at most `vocab_size` tokens) into `path`.

    Writes `tokenizer.json`, `tokenizer_config.json` (ChatML template, eos `<|im_end|>`) and
    `generation_config.json`. `PreTrainedTokenizerFast` loads `tokenizer.json` verbatim, which
    model-specific classes (Qwen2Tokenizer, ...) in transformers 5 do not promise.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab_size))
    added_tokens = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(TOKENIZER_SPECIAL_TOKENS)
    }
    _write_json(
        path / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": _CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": None,
        },
    )
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": ENDOFTEXT_ID,
            "do_sample": True,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID,
            "temperature": 0.7,
            "top_k": 20,
            "top_p": 0.8,
            "transformers_version": "4.57.0",
        },
    )
