"""What the commands share: option types, fixed choices, early value checks, error handling.

Checked here, before any heavy import (MLX, mlx-lm take seconds), so a bad value costs nothing.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Annotated, Any

import typer

from mtpkit.core import signals
from mtpkit.core.choices import (
    BITS,
    DTYPES,
    GROUP_SIZES,
    HIDDEN_VARIANTS,
    LAYOUTS,
)
from mtpkit.core.choices import require_depth as require_depth  # the commands' depth check
from mtpkit.core.console import quiet_libraries
from mtpkit.core.environment import check_environment
from mtpkit.core.errors import MtpkitError, one_line

# Exit code for "the checkpoint was read, and it fails what was required of it".
EXIT_FAILED_REQUIREMENT = 3

SourceArg = Annotated[
    str, typer.Argument(help="A local checkpoint directory or a Hugging Face Hub repo id.")
]
RevisionOpt = Annotated[
    str | None, typer.Option("--revision", help="Hub branch, tag or commit (Hub repos only).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


# Options with fixed choices: Click lists them in --help and rejects others as usage errors
# (exit 2). The values are the library's own (`mtpkit.core.choices`).
def choices(name: str, values: Iterable[object], prefix: str = "") -> Any:
    """A str Enum whose members are `values` (named `prefix` + value), for a Typer option."""
    return Enum(name, [(f"{prefix}{v}", str(v)) for v in values], type=str)


Dtype = choices("Dtype", DTYPES)
Layout = choices("Layout", LAYOUTS)
Hidden = choices("Hidden", HIDDEN_VARIANTS)
Bits = choices("Bits", BITS, prefix="b")
GroupSize = choices("GroupSize", GROUP_SIZES, prefix="g")


class RandomShape(str, Enum):
    qwen3_5_0_8b = "qwen3_5-0.8b"
    qwen3_5_4b = "qwen3_5-4b"
    qwen3_5_9b = "qwen3_5-9b"
    qwen3_5_moe_35b_a3b_8l = "qwen3_5_moe-35b-a3b-8l"


class ScaleDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


def value(choice: Enum | None) -> Any:
    return None if choice is None else choice.value


def number(choice: Enum | None) -> int | None:
    return None if choice is None else int(choice.value)


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Any error becomes one `Error: ...` line on stderr and exit 1 (MTPKIT_DEBUG=1: the
    traceback): a user-fixable one with its message, anything else with its type and first
    line. Typer's own exits and usage errors (exit 2) pass through."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            check_environment()  # before anything reads a variable (huggingface_hub: on import)
            quiet_libraries()
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: cleanup has run on the way
            if os.environ.get("MTPKIT_DEBUG") == "1":
                raise
            typer.echo(f"Error: {signals.message(e)}", err=True)
            raise typer.Exit(signals.exit_code(e)) from None
        except Exception as e:  # noqa: BLE001 - the one place every error is turned into a line
            if os.environ.get("MTPKIT_DEBUG") == "1":
                raise
            typer.echo(f"Error: {one_line(e)}", err=True)
            raise typer.Exit(e.exit_code if isinstance(e, MtpkitError) else 1) from None

    return wrapper


# Options of `convert` and `generate`, declared here to keep the signatures short.
BitsOpt = Annotated[
    Bits | None, typer.Option("--bits", help="Quantize to this many bits (affine).")
]
GroupSizeOpt = Annotated[
    GroupSize | None, typer.Option("--group-size", help="Quantization group size.")
]
KeepMtpBf16Opt = Annotated[
    bool,
    typer.Option(
        "--keep-mtp-bf16",
        help="Leave every MTP tensor unquantized (float16 with --dtype float16, else bfloat16).",
    ),
]
MtpBitsOpt = Annotated[
    Bits | None, typer.Option("--mtp-bits", help="Quantize the MTP head at this many bits.")
]
DtypeOpt = Annotated[
    Dtype | None, typer.Option("--dtype", help="The dtype of unquantized weights.")
]
LayoutOpt = Annotated[
    Layout | None,
    typer.Option(
        "--layout",
        help="sidecar (default: head in mtp/) or inline (also in the model shards, "
        "Qwen3.5/3.6 only).",
    ),
]


def finite(value: float) -> float:
    """A number option must be a number: `nan` and `inf` are usage errors (exit 2)."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


TempOpt = Annotated[
    float,
    typer.Option("--temp", min=0.0, callback=finite, help="Sampling temperature; 0 is greedy."),
]
TopPOpt = Annotated[
    float,
    typer.Option(
        "--top-p",
        min=0.0,
        max=1.0,
        help="Nucleus sampling: keep this much probability mass (1, the default, is off; so is 0).",
    ),
]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Sample among the top K (0: off).")]


def read_stdin_prompt() -> str:
    """`--prompt -`: standard input as UTF-8 text; other bytes are one line naming where."""
    import sys

    stream = getattr(sys.stdin, "buffer", None)
    data = stream.read() if stream is not None else sys.stdin.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MtpkitError(
            f"--prompt -: standard input is not UTF-8 text (byte 0x{data[e.start]:02x} at "
            f"offset {e.start}): pass the prompt as UTF-8"
        ) from None
