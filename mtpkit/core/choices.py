"""The fixed choices every stage shares, defined once: the library checks against these and
the CLI's enums (`mtpkit.cli.options`) are built from them. Importing this module is free
(no MLX), so the CLI checks a value before any heavy import.
"""

from __future__ import annotations

from mtpkit.core.errors import MtpkitError

# Floating dtypes a conversion writes (`--dtype`) and a trained head is stored in.
DTYPES = ("bfloat16", "float16", "float32")
# Quantization (`--q-bits`, `--mtp-bits`, `--q-group-size`), as mlx-lm supports it; affine
# takes group sizes 32, 64 and 128 only (16 is nvfp4's).
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (16, 32, 64, 128)
AFFINE_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
# mlx_lm.convert's --q-mode choices and the (group_size, bits) each defaults to
# (`defaults_for_mode` in mlx_lm.utils.quantize_model); the floating-point modes allow only
# their own pair.
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
MODES = tuple(MODE_DEFAULTS)
# mlx_lm.convert's --quant-predicate recipes (mlx_lm.convert.QUANT_RECIPES).
QUANT_PREDICATES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
# Where a conversion keeps the head: mtp/ only, or also in the model shards.
LAYOUTS = ("sidecar", "inline")

# The hidden state the head drafts from: the final norm's output or its input.
POST_NORM = "post_norm"
PRE_NORM = "pre_norm"
HIDDEN_VARIANTS = (POST_NORM, PRE_NORM)
# What the runtime feeds the head when a checkpoint records nothing (vLLM/transformers default).
DEFAULT_HIDDEN = POST_NORM

# Which normed input comes first in the head's projection over [embedding; hidden].
EMBEDDING_FIRST = "embedding_first"
HIDDEN_FIRST = "hidden_first"
CONCAT_ORDERS = (EMBEDDING_FIRST, HIDDEN_FIRST)

# Draft depths (tokens the head proposes per round) the runtime and train-head support.
MIN_DEPTH = 1
MAX_DEPTH = 4

# Nucleus sampling off: keep all the probability mass (mlx-lm's sampler reads 0 as off too).
TOP_P_OFF = 1.0


def require_depth(depth: int) -> None:
    """A draft depth in MIN_DEPTH..MAX_DEPTH, else the one-line error every command gives."""
    if not MIN_DEPTH <= depth <= MAX_DEPTH:
        raise MtpkitError(f"--depth must be between {MIN_DEPTH} and {MAX_DEPTH}, not {depth}")
