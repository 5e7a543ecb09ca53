"""One validation layer: what mtpkit checks before it trusts a value it read.

- Config values: types and ranges of the fields mtpkit and mlx-lm build from (`invalid_config`),
  and the declared MTP layer count against the layers the weights hold
  (`mtp_layer_count_mismatch`; convert writes the true count).
- Safetensors headers: tensor byte ranges must tile the data area exactly, as the safetensors
  library requires (it rejects overlapping or gapped `data_offsets`); `headers.py` raises
  `corrupt_header` on what `offsets_problem` finds.
- Head weights: NaN or Inf in the MTP head's floating-point tensors (`head_not_finite`).
- The tokenizer against the model: ids past `vocab_size` (`tokenizer_exceeds_vocab`).

inspect, convert and check report these through their own problem lists and checks; CLI option
values are checked in `options.py`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpkit.core.choices import BITS, GROUP_SIZES
from mtpkit.core.config import INVALID_CONFIG, as_count
from mtpkit.core.errors import InvalidConfig, more_of

# Stable problem codes added by this layer (documented in README.md).
LAYER_COUNT_MISMATCH = "mtp_layer_count_mismatch"
HEAD_NOT_FINITE = "head_not_finite"
TOKENIZER_EXCEEDS_VOCAB = "tokenizer_exceeds_vocab"

# Config fields (in `text_config` when there is one) and the least value each may take.
# Absent fields are mlx-lm's business; present ones must be integers in range.
CONFIG_COUNTS: dict[str, int] = {
    "num_hidden_layers": 1,
    "hidden_size": 1,
    "vocab_size": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "intermediate_size": 1,
    "moe_intermediate_size": 1,
    "num_experts": 0,
    "n_routed_experts": 0,
    "num_experts_per_tok": 1,
    "max_position_embeddings": 1,
    "head_dim": 1,
}
# Sizes every model has: an explicit null is as wrong as a word (absent is mlx-lm's business).
NEVER_NULL = ("num_hidden_layers", "hidden_size", "vocab_size")
# The most each count may be: far past any published model, short of sizes that would make
# a loader allocate terabytes before failing (hidden_size 10^12, a vocabulary of 2^40).
CONFIG_MOST: dict[str, int] = {
    "num_hidden_layers": 1 << 12,
    "hidden_size": 1 << 17,
    "vocab_size": 1 << 23,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "num_experts": 1 << 16,
    "n_routed_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16,
    "max_position_embeddings": 1 << 31,
}
# Fields that must be positive finite numbers when present (mlx-lm builds norms and RoPE).
CONFIG_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
# Fields that must be JSON booleans when present.
CONFIG_FLAGS = ("tie_word_embeddings",)
# The quantization mlx-lm can load: bits and group sizes (affine's, and nvfp4's 16).
QUANT_BITS = BITS
QUANT_GROUP_SIZES = GROUP_SIZES
# More MTP layers than this is no published model (they ship 1, a few at most).
MAX_MTP_LAYERS = 64


@dataclass(frozen=True)
class Problem:
    code: str
    message: str


def _field(config: dict[str, Any], key: str) -> tuple[str, Any] | None:
    text = config.get("text_config")
    if isinstance(text, dict) and key in text:
        return f"text_config.{key}", text[key]
    if key in config:
        return key, config[key]
    return None


def config_problems(config: dict[str, Any], mtp_field: str) -> list[Problem]:
    """Values of `config.json` with the wrong type or out of range (`invalid_config`): every
    field mtpkit or mlx-lm builds from, checked here once, before anything is built."""
    problems = []
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        problems.append(Problem(INVALID_CONFIG, "config.json: text_config is not an object"))
    mtp_key = mtp_field.rsplit(".", 1)[-1]
    for key, least in {**CONFIG_COUNTS, mtp_key: 0}.items():
        found = _field(config, key)
        if found is None or (found[1] is None and key not in NEVER_NULL):
            continue
        name, value = found
        count = as_count(value)
        most = CONFIG_MOST.get(key)
        if count is None:
            problems.append(
                Problem(INVALID_CONFIG, f"config.json: {name}={value!r} is not an integer")
            )
        elif count < least and key != mtp_key:  # a negative MTP count is a layer mismatch
            problems.append(
                Problem(INVALID_CONFIG, f"config.json: {name}={count} must be at least {least}")
            )
        elif most is not None and count > most:
            problems.append(
                Problem(
                    INVALID_CONFIG,
                    f"config.json: {name}={count} is past any model (at most {most})",
                )
            )
    problems += _value_problems(config)
    return problems


def _positive(value: Any) -> bool:
    real = isinstance(value, (int, float)) and not isinstance(value, bool)
    return real and math.isfinite(value) and value > 0


def _value_problems(config: dict[str, Any]) -> list[Problem]:
    """Numbers, flags and the quantization block (see CONFIG_NUMBERS, CONFIG_FLAGS)."""
    problems = []
    for key in CONFIG_NUMBERS:
        found = _field(config, key)
        if found is None or found[1] is None:
            continue
        name, value = found
        values = value if isinstance(value, list) and value else [value]  # per layer (Step 3.5)
        if not all(_positive(v) for v in values):
            problems.append(
                Problem(INVALID_CONFIG, f"config.json: {name}={value!r} is not a positive number")
            )
    for key in CONFIG_FLAGS:
        found = _field(config, key)
        if found is not None and found[1] is not None and not isinstance(found[1], bool):
            problems.append(
                Problem(INVALID_CONFIG, f"config.json: {found[0]}={found[1]!r} is not true/false")
            )
    for key in ("rope_scaling", "rope_parameters"):
        found = _field(config, key)
        if found is not None and found[1] is not None and not isinstance(found[1], dict):
            problems.append(
                Problem(INVALID_CONFIG, f"config.json: {found[0]}={found[1]!r} is not an object")
            )
    found = _field(config, "eos_token_id")
    if found is not None and found[1] is not None:
        ids = found[1] if isinstance(found[1], list) else [found[1]]
        if not ids or any(as_count(i) is None or as_count(i) < 0 for i in ids):
            problems.append(
                Problem(
                    INVALID_CONFIG,
                    f"config.json: {found[0]}={found[1]!r} is not a token id or a list of them",
                )
            )
    for key in ("quantization", "quantization_config"):
        quant = config.get(key)
        if quant is None or "quantization" in config and key == "quantization_config":
            continue  # mlx-lm reads `quantization` first; transformers' own form is not its
        if not isinstance(quant, dict):
            problems.append(Problem(INVALID_CONFIG, f"config.json: {key} is not an object"))
            continue
        bits, group = quant.get("bits"), quant.get("group_size")
        if bits is not None and as_count(bits) not in QUANT_BITS:
            problems.append(
                Problem(
                    INVALID_CONFIG,
                    f"config.json: {key}.bits={bits!r} is not one of "
                    f"{', '.join(map(str, QUANT_BITS))}",
                )
            )
        if group is not None and as_count(group) not in QUANT_GROUP_SIZES:
            problems.append(
                Problem(
                    INVALID_CONFIG,
                    f"config.json: {key}.group_size={group!r} is not one "
                    f"of {', '.join(map(str, QUANT_GROUP_SIZES))}",
                )
            )
    return problems


def mtp_field_valid(config: dict[str, Any], mtp_field: str) -> bool:
    found = _field(config, mtp_field.rsplit(".", 1)[-1])
    return found is None or found[1] is None or as_count(found[1]) is not None


def present_layers(relative_names: Iterable[str | None]) -> int:
    """MTP layers the weights hold, from head-relative names (`layers.{i}.…`)."""
    layers = {m.group(1) for n in relative_names if n and (m := re.match(r"layers\.(\d+)\.", n))}
    return len(layers)


def layer_count_problem(field: str, declared: int | None, present: int) -> Problem | None:
    """A declared MTP layer count that disagrees with the layers the weights hold."""
    if not declared or not present or declared == present:
        return None
    odd = " (not a layer count)" if declared < 0 or declared > MAX_MTP_LAYERS else ""
    return Problem(
        LAYER_COUNT_MISMATCH,
        f"config declares {field}={declared}{odd} but the weights hold {present} MTP "
        f"layer(s): set {field} to {present} (`mtpkit convert` writes the true count)",
    )


def offsets_problem(spans: Iterable[tuple[str, int, int]], data_size: int) -> str | None:
    """Tensor byte ranges `(name, begin, end)` that do not tile `[0, data_size)` exactly.

    The safetensors library rejects such a file (overlapping ranges alias two tensors'
    bytes; a gap or trailing bytes mean the header and the data disagree).
    """
    position, previous = 0, None
    for name, begin, end in sorted(spans, key=lambda s: (s[1], s[2])):
        if begin < position:
            return f"{name} data_offsets [{begin}, {end}] overlap {previous}'s bytes"
        if begin > position:
            after = f"after {previous}" if previous else "at the start"
            return f"{begin - position} bytes {after} belong to no tensor (gap before {name})"
        position, previous = end, name
    if position != data_size:
        return f"the tensors cover {position} of the {data_size} data bytes"
    return None


def nonfinite_tensors(files: dict[Path, list[str] | None]) -> Iterator[str]:
    """Names of the listed floating-point tensors (None: all of a file's) that hold NaN or
    Inf, read lazily one by one; packed quantized weights are integers and are skipped,
    their scales are not."""
    import mlx.core as mx

    for path, names in files.items():
        tensors = mx.load(str(path), format="safetensors")  # a temp sibling has no suffix
        for name in tensors if names is None else names:
            t = tensors.get(name)
            if t is None or not mx.issubdtype(t.dtype, mx.floating):
                continue
            if not mx.all(mx.isfinite(t)).item():
                yield name


def require_valid_config(config: dict[str, Any], mtp_field: str, where: str) -> None:
    """Raise `InvalidConfig` on the first `config_problems` of a model about to be loaded
    (generate, bench, check's probes), so the loader never builds from a bad value."""
    problems = config_problems(config, mtp_field)
    if problems:
        more = more_of(problems)
        message = problems[0].message.removeprefix("config.json: ")
        raise InvalidConfig(
            f"config.json in {where}: {message}{more} ({INVALID_CONFIG}): fix config.json or "
            "convert from the original checkpoint"
        )


def tokenizer_size(tokenizer: Any) -> int | None:
    """How many ids a `tokenizer.json` can produce (its largest id + 1: the vocabulary's and
    the added tokens'), or None when it does not say."""
    if not isinstance(tokenizer, dict):
        return None
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids = []
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids += [i for i in vocab.values() if isinstance(i, int) and not isinstance(i, bool)]
    elif isinstance(vocab, list) and vocab:  # Unigram: [token, score] pairs, ids in order
        ids.append(len(vocab) - 1)
    for token in tokenizer.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            ids.append(token["id"])
    return max(ids) + 1 if ids else None


def tokenizer_problem(config: dict[str, Any], tokenizer: Any, where: str) -> Problem | None:
    """A tokenizer whose ids reach past the model's `vocab_size` (`tokenizer_exceeds_vocab`):
    those ids index past the embedding table, and MLX reads whatever lies there."""
    size = tokenizer_size(tokenizer)
    found = _field(config, "vocab_size")
    vocab = as_count(found[1]) if found is not None else None
    if size is None or vocab is None or size <= vocab:
        return None
    return Problem(
        TOKENIZER_EXCEEDS_VOCAB,
        f"tokenizer.json in {where} has ids up to {size - 1} but config.json's {found[0]} is "
        f"{vocab}: ids past {vocab - 1} index past the embedding table; use the model's own "
        "tokenizer files",
    )


def require_tokenizer_fits(config: dict[str, Any], directory: Path, where: str) -> None:
    """Raise `InvalidConfig` for a model directory whose tokenizer.json reaches past its
    vocabulary (`tokenizer_problem`), before a model is loaded to decode with it."""
    import json

    try:
        tokenizer = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):  # absent or unreadable: the loader says
        return
    problem = tokenizer_problem(config, tokenizer, where)
    if problem is not None:
        raise InvalidConfig(f"{problem.message} ({problem.code})")


def quantization_problem(config: dict[str, Any], names: Iterable[str]) -> Problem | None:
    """Quantized tensors (`*.scales`) under a config.json without its `quantization` block:
    mlx-lm would build float layers and refuse every scale and bias as an unknown parameter."""
    if config.get("quantization") or config.get("quantization_config"):
        return None
    scales = sorted(n for n in names if n.endswith(".scales"))
    if not scales:
        return None
    return Problem(
        INVALID_CONFIG,
        f"config.json has no quantization block but {len(scales)} tensors are quantized "
        f"({scales[0]}{more_of(scales)}): restore its quantization block (bits, group_size, "
        "mode) from the conversion, or convert from the original checkpoint",
    )
