"""What the commands share: option types, fixed choices, early value checks, error handling.

Checked here, before any heavy import (MLX, mlx-lm take seconds), so a bad value costs nothing.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Annotated, Any

import typer

from mtpkit.cli.values import among, ranged
from mtpkit.core import signals
from mtpkit.core.choices import (
    BITS,
    DTYPES,
    GROUP_SIZES,
    HIDDEN_VARIANTS,
    LAYOUTS,
    MAX_DEPTH,
    MIN_DEPTH,
    MODES,
    QUANT_PREDICATES,
)
from mtpkit.core.choices import require_depth as require_depth  # the commands' depth check
from mtpkit.core.console import closed_pipe_exit_code, quiet_libraries
from mtpkit.core.environment import check_environment
from mtpkit.core.errors import MtpkitError, one_line

# Exit code for "the checkpoint was read, and it fails what was required of it".
EXIT_FAILED_REQUIREMENT = 3

SourceArg = Annotated[
    str | None,
    typer.Argument(
        metavar="SOURCE",
        help="A local checkpoint directory or a Hugging Face Hub repo id (or --model).",
        show_default=False,
    ),
]
# mlx-lm names the model with --model on every command (convert also takes --hf-path).
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", metavar="SOURCE", help="The same as SOURCE (mlx-lm's spelling)."),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", metavar="REV", help="Hub branch, tag or commit (Hub repos only)."),
]
JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Print one JSON object on stdout (on an error: {error, exit_code}).",
    ),
]
QuietOpt = Annotated[bool, typer.Option("--quiet", help="No progress bar.")]
# mtpkit never runs a checkpoint's own code; the flag is accepted so mlx-lm command lines run.
TrustRemoteCodeOpt = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Accepted for mlx-lm's command lines; mtpkit never runs a checkpoint's own code.",
    ),
]
REMOTE_CODE_NOTE = (
    "note: mtpkit never runs a checkpoint's own code; --trust-remote-code changes nothing "
    "(every supported family is built from mlx-lm's classes)"
)


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
QuantMode = choices("QuantMode", MODES)
QuantPredicate = choices("QuantPredicate", QUANT_PREDICATES)


class RandomShape(str, Enum):
    qwen3_5_0_8b = "qwen3_5-0.8b"
    qwen3_5_4b = "qwen3_5-4b"
    qwen3_5_9b = "qwen3_5-9b"
    qwen3_5_moe_35b_a3b_8l = "qwen3_5_moe-35b-a3b-8l"
    qwen3_4b = "qwen3-4b"
    qwen3_8b = "qwen3-8b"


class ScaleDtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


def value(choice: Enum | None) -> Any:
    return None if choice is None else choice.value


def number(choice: Enum | None) -> int | None:
    return None if choice is None else int(choice.value)


def one_source(
    ctx: typer.Context, source: str | None, model: str | None, *, name: str = "SOURCE"
) -> str:
    """The model named as the argument `name` (SOURCE; train-head's MODEL) or with --model
    (mlx-lm's spelling): once, and not twice differently; otherwise a usage error (exit 2)
    that names the argument as the usage line does."""
    if source is not None and model is not None and source != model:
        ctx.fail(f"got {name} {source!r} and --model {model!r}: name the model once")
    chosen = source if source is not None else model
    if chosen is None:
        ctx.fail(f"Missing argument '{name}' (or --model {name}).")
    return chosen


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Any error becomes one `Error: ...` line on stderr and exit 1 (MTPKIT_DEBUG=1: the
    traceback): a user-fixable one with its message, anything else with its type and first
    line, either way one printable line (`one_line`); a closed stdout ends quietly with the
    code of a SIGPIPE'd Unix tool (141); with --json, stdout gets `{"error": ..., "exit_code": ...}` as well, so a script
    reading stdout sees why. Typer's own exits and usage errors (exit 2) pass through."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            check_environment()  # before anything reads a variable (huggingface_hub: on import)
            quiet_libraries()
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except BrokenPipeError:  # the reader of stdout went away: end quietly, as Unix tools do
            raise typer.Exit(closed_pipe_exit_code()) from None
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: cleanup has run on the way
            if os.environ.get("MTPKIT_DEBUG") == "1":
                raise
            from mtpkit.cli.ranks import rank_number

            # Under mlx.launch rank 0 speaks for all: the others are ended by the launcher
            # once one rank exits, and that is no news of theirs.
            if not rank_number():
                typer.echo(f"Error: {signals.message(e)}", err=True)
            raise typer.Exit(signals.exit_code(e)) from None
        except Exception as e:  # noqa: BLE001 - the one place every error is turned into a line
            if os.environ.get("MTPKIT_DEBUG") == "1":
                raise
            message = one_line(e)
            code = e.exit_code if isinstance(e, MtpkitError) else 1
            if kwargs.get("json_output"):
                sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
                sys.stdout.flush()
            typer.echo(f"Error: {message}", err=True)
            raise typer.Exit(code) from None

    return wrapper


# Options of `convert` and `generate`, declared here to keep the signatures short; mlx-lm's
# names first, mtpkit's earlier ones kept as aliases.
QuantizeOpt = Annotated[
    bool,
    typer.Option(
        "--quantize",
        "-q",
        help="Quantize the backbone as mlx_lm.convert -q does (affine: 4 bits, group 64).",
    ),
]
BitsOpt = Annotated[
    Bits | None,
    typer.Option(
        "--q-bits",
        "--bits",
        **among(Bits),
        help="Bits per weight (implies -q; default: the mode's).",
    ),
]
GroupSizeOpt = Annotated[
    GroupSize | None,
    typer.Option(
        "--q-group-size",
        "--group-size",
        **among(GroupSize),
        help="Quantization group size (default: the mode's; also --mtp-bits').",
    ),
]
QuantModeOpt = Annotated[
    QuantMode | None,
    typer.Option(
        "--q-mode",
        **among(QuantMode),
        help="Quantization mode (implies -q): affine (default), or mxfp4/nvfp4/mxfp8 with "
        "their fixed bits and group size.",
    ),
]
QuantPredicateOpt = Annotated[
    QuantPredicate | None,
    typer.Option(
        "--quant-predicate",
        **among(QuantPredicate),
        help="mlx-lm's mixed-bit recipe (implies -q; affine only); the head follows its rule "
        "for the layer after the last unless --mtp-bits or --keep-mtp-bf16 says otherwise.",
    ),
]
KeepMtpBf16Opt = Annotated[
    bool,
    typer.Option(
        "--keep-mtp-bf16",
        help="Leave every MTP tensor unquantized (float16 with --dtype float16, else bfloat16).",
    ),
]
MtpBitsOpt = Annotated[
    Bits | None,
    typer.Option(
        "--mtp-bits", **among(Bits), help="Quantize the MTP head at this many bits (affine)."
    ),
]
DtypeOpt = Annotated[
    Dtype | None, typer.Option("--dtype", **among(Dtype), help="The dtype of unquantized weights.")
]
LayoutOpt = Annotated[
    Layout | None,
    typer.Option(
        "--layout",
        **among(Layout),
        help="sidecar (default: head in mtp/) or inline (also in the model shards, "
        "Qwen3.5/3.6 only).",
    ),
]


TempOpt = Annotated[
    float,
    typer.Option(
        "--temp",
        **ranged(float, min=0.0),
        metavar="T",
        help="Sampling temperature; 0 is greedy.",
    ),
]
TopPOpt = Annotated[
    float,
    typer.Option(
        "--top-p",
        **ranged(float, min=0.0, max=1.0),
        metavar="P",
        help="Nucleus sampling: keep this much probability mass (1, the default, is off; so is 0).",
    ),
]
MinPOpt = Annotated[
    float,
    typer.Option(
        "--min-p",
        **ranged(float, min=0.0, max=1.0),
        metavar="P",
        help="Drop tokens below this fraction of the top token's probability (0: off).",
    ),
]
TopKOpt = Annotated[
    int,
    typer.Option(
        "--top-k", **ranged(int, min=0), metavar="K", help="Sample among the top K (0: off)."
    ),
]
DepthOpt = Annotated[
    int | None,
    typer.Option(
        "--depth",
        "--num-draft-tokens",
        **ranged(int, min=MIN_DEPTH, max=MAX_DEPTH),
        metavar="K",
        help=f"Draft tokens per step, {MIN_DEPTH}..{MAX_DEPTH} (the head chained). Default: "
        "chosen each round by adaptive drafting (1-3), or 1 with --no-adaptive.",
    ),
]
# mlx_lm.generate's options beyond sampling and the prompt (`MlxLmOptions`), same meanings.
AdapterPathOpt = Annotated[
    str | None,
    typer.Option(
        "--adapter-path",
        metavar="DIR",
        help="LoRA adapters (mlx_lm.lora's output) applied to the model.",
    ),
]
PrefillStepSizeOpt = Annotated[
    int,
    typer.Option(
        "--prefill-step-size", min=1, metavar="N", help="Prompt tokens per prefill forward."
    ),
]
KvBitsOpt = Annotated[
    int | None,
    typer.Option(
        "--kv-bits",
        min=1,
        max=8,
        metavar="B",
        help="Quantize the KV cache to B bits (plain decoding only, as mlx-lm's).",
    ),
]
KvGroupSizeOpt = Annotated[
    int,
    typer.Option(
        "--kv-group-size", min=1, metavar="G", help="With --kv-bits: the quantization group size."
    ),
]
QuantizedKvStartOpt = Annotated[
    int,
    typer.Option(
        "--quantized-kv-start",
        min=0,
        metavar="N",
        help="With --kv-bits: quantize from this many cached tokens on.",
    ),
]
PromptCacheFileOpt = Annotated[
    str | None,
    typer.Option(
        "--prompt-cache-file",
        metavar="FILE",
        help="A prompt cache saved by mlx_lm.cache_prompt (plain decoding only).",
    ),
]
UseDefaultChatTemplateOpt = Annotated[
    bool,
    typer.Option(
        "--use-default-chat-template",
        help="Use the tokenizer's default chat template when it has none.",
    ),
]
ChatTemplateConfigOpt = Annotated[
    str | None,
    typer.Option(
        "--chat-template-config",
        metavar="JSON",
        help="Extra arguments for the chat template, a JSON object.",
    ),
]
MinTokensToKeepOpt = Annotated[
    int,
    typer.Option(
        "--min-tokens-to-keep", min=1, metavar="N", help="Minimum tokens min-p sampling keeps."
    ),
]
XtcProbabilityOpt = Annotated[
    float,
    typer.Option(
        "--xtc-probability",
        min=0.0,
        max=1.0,
        metavar="P",
        help="XTC sampling's probability per token (plain decoding only).",
    ),
]
XtcThresholdOpt = Annotated[
    float,
    typer.Option(
        "--xtc-threshold",
        min=0.0,
        max=0.5,
        metavar="T",
        help="XTC sampling's probability threshold.",
    ),
]
DrafterModelOpt = Annotated[
    str | None,
    typer.Option(
        "--draft-model",
        metavar="DIR",
        help="Draft with this separate model (a local MLX directory or a Hub repo of the same "
        "tokenizer) instead of the MTP head; hybrid targets and draft models included; for a "
        "Gemma 4 target, its MTP assistant; a DFlash block drafter's directory (recognised from "
        "its config.json) drafts a block per pass from the target's hidden layers; an EAGLE-3 "
        "drafter's (recognised too) chains its drafts over three of the target's layers.",
    ),
]
PromptLookupOpt = Annotated[
    bool,
    typer.Option(
        "--prompt-lookup",
        help="Draft by prompt lookup instead of the MTP head: the tokens that followed the "
        "latest earlier occurrence of the last n tokens (any model; no extra weights).",
    ),
]
PromptLookupMinOpt = Annotated[
    int,
    typer.Option(
        "--prompt-lookup-min",
        min=1,
        max=64,
        metavar="N",
        help="Shortest n-gram prompt lookup matches.",
    ),
]
PromptLookupMaxOpt = Annotated[
    int,
    typer.Option(
        "--prompt-lookup-max",
        min=1,
        max=64,
        metavar="N",
        help="Longest n-gram prompt lookup matches.",
    ),
]
MaxTokensOpt = Annotated[
    int,
    typer.Option(
        "--max-tokens", "-m", **ranged(int, min=1), metavar="N", help="Tokens to generate."
    ),
]


def read_stdin_prompt() -> str:
    """`--prompt -`: standard input as UTF-8 text; other bytes are one line naming where."""
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


# Options of a command run under `mlx.launch` (`mtpkit.cli.ranks`).
PipelineOpt = Annotated[
    bool,
    typer.Option(
        "--pipeline",
        help="Under mlx.launch: pipeline stages instead of tensor parallelism, for models "
        "mlx-lm can shard both ways (as mlx_lm.server --pipeline).",
    ),
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        **ranged(float, min=1),
        metavar="SECONDS",
        help="Under mlx.launch: seconds a rank waits for the others before ending with an error.",
    ),
]


# A seed is MLX's: an unsigned 64-bit integer (`mx.random.seed`).
SEED_MAX = 2**64 - 1


# Options of `generate`: mlx_lm.generate's names and meanings.
def str2bool(text: str) -> bool:
    """mlx_lm.generate's --verbose value: 'False'/'F' (any case) is false; so are 'no', '0'."""
    if text.lower() in ("false", "f", "no", "n", "0"):
        return False
    if text.lower() in ("true", "t", "yes", "y", "1"):
        return True
    raise typer.BadParameter(f"{text!r} is not True or False")


GenerateModelOpt = Annotated[
    str, typer.Option("--model", metavar="SOURCE", help="A model directory or Hub repo id.")
]
# mlx_lm.generate's default prompt (DEFAULT_PROMPT).
DEFAULT_PROMPT = "hello"
PromptOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--prompt",
        "-p",
        metavar="TEXT",
        show_default=DEFAULT_PROMPT,
        help="The prompt; - reads stdin; \\n and \\t are read as newline and tab (as mlx-lm). "
        "Given more than once: the prompts decode together in one batch (with MTP, each "
        "request accepting on its own; --no-mtp: mlx-lm's batch_generate).",
    ),
]
SystemPromptOpt = Annotated[
    str | None,
    typer.Option("--system-prompt", metavar="TEXT", help="System prompt for the chat template."),
]
PrefillResponseOpt = Annotated[
    str | None,
    typer.Option(
        "--prefill-response",
        metavar="TEXT",
        help="Start of the answer for the chat template; generation continues it.",
    ),
]
IgnoreChatTemplateOpt = Annotated[
    bool,
    typer.Option(
        "--ignore-chat-template", help="Use the raw prompt (the same as --no-chat-template)."
    ),
]
MaxKvSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--max-kv-size",
        **ranged(int, min=1),
        metavar="N",
        help="Keep at most N tokens in each attention cache (rotating, as mlx-lm's).",
    ),
]
ExtraEosTokenOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--extra-eos-token",
        metavar="TOKEN",
        help="Also stop at this token or id (several: --extra-eos-token A B, as mlx-lm, or the option repeated).",
    ),
]
VerboseOpt = Annotated[
    str,
    typer.Option(
        "--verbose",
        metavar="BOOL",
        callback=lambda v: str(str2bool(v)),
        help="True (default): mlx-lm's framing and Prompt/Generation/Peak memory/MTP lines; "
        "False: only the text.",
    ),
]


MtpOpt = Annotated[
    bool | None,
    typer.Option(
        "--mtp/--no-mtp",
        help="--mtp: draft with the MTP head (an error without one); --mtp auto, or neither "
        "flag: use the head when there is one, else warn and decode plainly; --no-mtp: "
        "plain decoding (stock mlx-lm).",
    ),
]
GenerateHiddenOpt = Annotated[
    Hidden | None,
    typer.Option(
        "--hidden", **among(Hidden), help="Hidden state fed to the head (default: the manifest's)."
    ),
]
AdaptiveOpt = Annotated[
    bool,
    typer.Option(
        "--adaptive/--no-adaptive",
        help="Pause drafting while it is slower than plain decoding, and without --depth "
        "choose each round's depth (1-3) from the head's acceptance.",
    ),
]
ChatTemplateOpt = Annotated[
    bool,
    typer.Option(
        "--chat-template/--no-chat-template",
        help="Apply the tokenizer's chat template, when it has one.",
    ),
]
SampleSeedOpt = Annotated[
    int | None,
    typer.Option(
        "--seed", **ranged(int, min=0, max=SEED_MAX), metavar="N", help="Random seed for sampling."
    ),
]


# Options of `bench`.
BenchModelOpt = Annotated[
    str | None,
    typer.Option("--model", metavar="SOURCE", help="A model directory or Hub repo id."),
]
RandomShapeOpt = Annotated[
    RandomShape | None,
    typer.Option(
        "--random",
        **among(RandomShape),
        help="Instead of --model, build a random-weight 4-bit model of this shape in a "
        "temporary directory (a qwen3 shape, which has no head, with a random DFlash drafter).",
    ),
]
RandomLayersOpt = Annotated[
    int | None,
    typer.Option(
        "--random-layers",
        **ranged(int, min=1),
        metavar="N",
        help="With --random: build only N layers (a multiple of 4 for a qwen3_5 shape), for "
        "a quicker build of the same widths.",
    ),
]
ScaleDtypeOpt = Annotated[
    ScaleDtype | None,
    typer.Option(
        "--dtype",
        **among(ScaleDtype),
        help="With --random: the dtype of the quantization scales and unquantized weights "
        "(default float32, which runs ~10x faster on Linux CPUs; published 4-bit models "
        "carry bfloat16).",
    ),
]
BenchPromptOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--prompt",
        "-p",
        metavar="TEXT",
        help="The prompt. With --batch, given more than once: row i decodes the i-th prompt "
        "(in turn, when the batch is wider).",
    ),
]
BenchMaxTokensOpt = Annotated[
    int,
    typer.Option("--max-tokens", "-m", **ranged(int, min=1), metavar="N", help="Tokens per run."),
]
BenchDepthOpt = Annotated[
    int,
    typer.Option(
        "--depth",
        **ranged(int, min=MIN_DEPTH, max=MAX_DEPTH),
        metavar="K",
        help="Measure depths 1..K.",
    ),
]
TrialsOpt = Annotated[
    int,
    typer.Option(
        "--trials",
        **ranged(int, min=1),
        metavar="N",
        help="Interleaved trials; each figure is their median and range.",
    ),
]
