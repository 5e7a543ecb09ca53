"""The `mtpkit` command line: thin Typer commands over the library functions."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any

import typer

from mtpkit import __version__
from mtpkit.errors import MtpkitError

app = typer.Typer(
    name="mtpkit",
    help="Keep, convert, run and check the multi-token-prediction (MTP) heads of open "
    "checkpoints on Apple's MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

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
# (exit 2). The values are the library's own (tests/test_cli.py holds them equal).
class Dtype(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Layout(str, Enum):
    sidecar = "sidecar"
    inline = "inline"


class Hidden(str, Enum):
    post_norm = "post_norm"
    pre_norm = "pre_norm"


class Bits(str, Enum):
    b2, b3, b4, b5, b6, b8 = "2", "3", "4", "5", "6", "8"


class GroupSize(str, Enum):
    g32, g64, g128 = "32", "64", "128"


class RandomShape(str, Enum):
    qwen3_5_0_8b = "qwen3_5-0.8b"


# Draft depths the runtime supports (mtpkit.generate.MAX_DEPTH).
MAX_DEPTH = 4


def _value(choice: Enum | None) -> Any:
    return None if choice is None else choice.value


def _number(choice: Enum | None) -> int | None:
    return None if choice is None else int(choice.value)


def _require_depth(depth: int) -> None:
    """Checked here, before the runtime's imports (seconds), with the runtime's message."""
    if not 1 <= depth <= MAX_DEPTH:
        raise MtpkitError(f"--depth must be between 1 and {MAX_DEPTH}, not {depth}")


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user-fixable error becomes `Error: ...` on stderr and exit 1 (MTPKIT_DEBUG=1: traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MtpkitError as e:
            if os.environ.get("MTPKIT_DEBUG") == "1":
                raise
            typer.echo(f"Error: {e}", err=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtpkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Keep, convert, run and check the MTP heads of open checkpoints on MLX."""


@app.command()
@friendly_errors
def inspect(
    source: SourceArg,
    revision: RevisionOpt = None,
    json_output: JsonOpt = False,
    require_mtp: Annotated[
        bool,
        typer.Option(
            "--require-mtp",
            help="Exit 3 when the MTP head is absent, declared but missing, or incomplete.",
        ),
    ] = False,
    tensors: Annotated[
        bool, typer.Option("--tensors/--no-tensors", help="List every MTP tensor (table only).")
    ] = True,
) -> None:
    """Report a checkpoint's MTP head from its config, index and safetensors headers.

    Reads no weights: on the Hub only the JSON files and a few kilobytes per shard are fetched.

    Exit 0 when the checkpoint could be read (problems are listed, not fatal), 3 with --require-mtp when the head is not usable, 1 on an error.
    """
    from mtpkit.inspect import head_state, inspect_checkpoint
    from mtpkit.output import print_inspect, print_json

    result = inspect_checkpoint(source, revision=revision)
    if json_output:
        print_json(result)
    else:
        print_inspect(result, show_tensors=tensors)
    if require_mtp and head_state(result) != "ok":
        raise typer.Exit(EXIT_FAILED_REQUIREMENT)


@app.command()
@friendly_errors
def check(
    source: SourceArg,
    revision: RevisionOpt = None,
    json_output: JsonOpt = False,
    junit: Annotated[
        str | None,
        typer.Option(
            "--junit", help="Also write a JUnit XML report to this file (for CI).", dir_okay=False
        ),
    ] = None,
    min_acceptance: Annotated[
        float,
        typer.Option(
            "--min-acceptance",
            min=0.0,
            max=1.0,
            help="Fail when greedy acceptance as shipped is below this.",
        ),
    ] = 0.2,
    probe: Annotated[
        bool | None,
        typer.Option(
            "--probe/--no-probe",
            help="Measure acceptance and diagnose conventions (default: on for directories, off "
            "for Hub repos, which would be downloaded or converted into a cache).",
            show_default=False,
        ),
    ] = None,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            help="Probe prompts: a JSON list of strings, or text with blank lines between prompts.",
            dir_okay=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Tokens generated per probe prompt.")
    ] = 48,
) -> None:
    """Check an MTP checkpoint for CI: structure, quantization, manifest and acceptance.

    Structural checks read only config, index, manifest and headers. The probes generate greedily with the head, then re-run it with its norms shifted by -1 and +1, with the other hidden-state variant and with the other concat order, to name a double or missing norm shift or a mismatched convention with its fix.

    Exit 0 on pass, 3 on fail, 1 on an error.
    """
    from mtpkit.check import check_checkpoint
    from mtpkit.output import log, print_check, print_json

    result = check_checkpoint(
        source,
        revision=revision,
        probe=probe,
        prompts_file=prompts,
        min_acceptance=min_acceptance,
        max_tokens=max_tokens,
        junit=junit,
        log=log,
    )
    if json_output:
        print_json(result)
    else:
        print_check(result)
    if result["verdict"] != "pass":
        raise typer.Exit(EXIT_FAILED_REQUIREMENT)


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
TempOpt = Annotated[
    float, typer.Option("--temp", min=0.0, help="Sampling temperature; 0 is greedy.")
]
TopPOpt = Annotated[
    float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling (0 or 1: off).")
]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Sample among the top K (0: off).")]


@app.command()
@friendly_errors
def convert(
    source: SourceArg,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="The MLX directory to write.")
    ] = None,
    revision: RevisionOpt = None,
    bits: BitsOpt = None,
    group_size: GroupSizeOpt = None,
    keep_mtp_bf16: KeepMtpBf16Opt = False,
    mtp_bits: MtpBitsOpt = None,
    dtype: DtypeOpt = None,
    layout: LayoutOpt = None,
    hidden: Annotated[
        Hidden | None,
        typer.Option(
            "--hidden",
            help="Hidden state the head expects, recorded in the manifest: post_norm "
            "(default) or pre_norm.",
        ),
    ] = None,
    recipe: Annotated[
        str | None, typer.Option("--recipe", help="A recipes/*.toml file; flags override it.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output.")] = False,
    mtp_only: Annotated[
        bool, typer.Option("--mtp-only", help="Graft only the MTP head (with --into).")
    ] = False,
    into: Annotated[
        str | None, typer.Option("--into", help="The existing MLX directory to graft into.")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Convert a checkpoint to an MLX directory that stock mlx-lm loads, keeping its MTP head.

    The backbone is written as mlx_lm.convert writes it (same names, quantization and dtypes); the head goes to mtp/weights.safetensors and every decision (norm shift, expert layout, quantization, source commit) to mtp/manifest.json. Without --bits nothing is quantized; with --bits the head is quantized like the backbone unless --keep-mtp-bf16 or --mtp-bits says otherwise.

    With --mtp-only --into DIR, only the head is read (on the Hub: its byte ranges) and added to an existing MLX conversion of the same model, quantized like it.
    """
    from mtpkit.convert import convert as convert_checkpoint
    from mtpkit.convert import graft
    from mtpkit.output import print_convert, print_json

    if mtp_only:
        if into is None or output is not None or bits is not None or layout or recipe or force:
            raise MtpkitError(
                "--mtp-only takes --into DIR and only the head flags "
                "(--keep-mtp-bf16, --mtp-bits, --group-size, --dtype)"
            )
        result = graft(
            source,
            into=into,
            revision=revision,
            keep_mtp_bf16=keep_mtp_bf16,
            mtp_bits=_number(mtp_bits),
            group_size=_number(group_size),
            dtype=_value(dtype),
            hidden=_value(hidden),
            quiet=quiet or json_output,
        )
    else:
        if output is None or into is not None:
            raise MtpkitError("pass -o OUT (or --mtp-only --into DIR to graft a head)")
        result = convert_checkpoint(
            source,
            output=output,
            revision=revision,
            bits=_number(bits),
            group_size=_number(group_size),
            keep_mtp_bf16=keep_mtp_bf16,
            mtp_bits=_number(mtp_bits),
            dtype=_value(dtype),
            layout=_value(layout),
            hidden=_value(hidden),
            recipe=recipe,
            force=force,
            quiet=quiet or json_output,
        )
    if json_output:
        print_json(result.as_dict())
    else:
        print_convert(result)


MtpOpt = Annotated[
    bool | None,
    typer.Option(
        "--mtp/--no-mtp",
        help="--mtp: draft with the MTP head (an error without one); --mtp auto, or neither "
        "flag: use the head when there is one, else warn and decode plainly; --no-mtp: "
        "plain decoding (stock mlx-lm).",
    ),
]
# `--mtp auto` parses as the --mtp flag followed by this word.
MtpAutoArg = Annotated[str | None, typer.Argument(hidden=True, metavar="[auto]")]


@app.command()
@friendly_errors
def generate(
    model: Annotated[str, typer.Option("--model", "-m", help="A model directory or Hub repo id.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt; - reads stdin.")],
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Tokens to generate.")
    ] = 256,
    mtp: MtpOpt = None,
    mtp_mode: MtpAutoArg = None,
    depth: Annotated[
        int, typer.Option("--depth", help="Draft tokens per step, 1..4 (the head chained).")
    ] = 1,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 0.0,
    top_k: TopKOpt = 0,
    seed: Annotated[int | None, typer.Option("--seed", help="Random seed for sampling.")] = None,
    hidden: Annotated[
        Hidden | None,
        typer.Option("--hidden", help="Hidden state fed to the head (default: the manifest's)."),
    ] = None,
    adaptive: Annotated[
        bool,
        typer.Option(
            "--adaptive/--no-adaptive",
            help="Pause drafting while it is slower than plain decoding.",
        ),
    ] = True,
    chat_template: Annotated[
        bool,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Apply the tokenizer's chat template, when it has one.",
        ),
    ] = True,
    json_output: JsonOpt = False,
) -> None:
    """Generate text, drafting tokens with the model's MTP head and verifying them losslessly.

    Greedy output is token for token the model's own (as stock mlx-lm's); at --temp > 0 exact rejection sampling keeps the model's distribution. Text streams to stdout; a summary goes to stderr.
    """
    import sys

    if mtp_mode not in (None, "auto") or (mtp_mode == "auto" and mtp is not True):
        raise MtpkitError(f"unexpected argument {mtp_mode!r}: the only word --mtp takes is 'auto'")
    mode: bool | str = "auto" if (mtp is None or mtp_mode == "auto") else mtp
    _require_depth(depth)
    text = sys.stdin.read() if prompt == "-" else prompt

    from mtpkit.generate import generate as run_generate
    from mtpkit.output import print_generate, print_json

    def stream(segment: str) -> None:
        sys.stdout.write(segment)
        sys.stdout.flush()

    result = run_generate(
        model,
        text,
        max_tokens=max_tokens,
        mtp=mode,
        depth=depth,
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        hidden=_value(hidden),
        adaptive=adaptive,
        chat_template=chat_template,
        on_token=None if json_output else stream,
        warn=lambda message: typer.echo(f"Warning: {message}", err=True),
    )
    if json_output:
        print_json(result.to_json())
        return
    sys.stdout.write("\n")
    print_generate(result)


@app.command()
@friendly_errors
def bench(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="A model directory or Hub repo id.")
    ] = None,
    random_shape: Annotated[
        RandomShape | None,
        typer.Option(
            "--random",
            help="Instead of --model, build a random-weight 4-bit model of this shape in a "
            "temporary directory.",
        ),
    ] = None,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per run.")] = 128,
    max_depth: Annotated[int, typer.Option("--depth", help="Measure depths 1..K.")] = 3,
    trials: Annotated[
        int,
        typer.Option("--trials", min=1, help="Interleaved trials; each figure is the best one."),
    ] = 3,
    json_output: JsonOpt = False,
) -> None:
    """Measure plain decoding (stock mlx-lm) against MTP decoding at depths 1..K.

    Reports decode tok/s and acceptance per depth, beta (a 2-token verify over a 1-token forward), delta (a head step over a 1-token forward), the realized speedup and its ceiling (1+a)/(beta+delta).
    """
    import shutil

    if (model is None) == (random_shape is None):
        raise MtpkitError("pass --model DIR or --random SHAPE")
    _require_depth(max_depth)
    shape = _value(random_shape)

    from mtpkit.bench import DEFAULT_PROMPT, print_bench, random_model_dir
    from mtpkit.bench import bench as run_bench
    from mtpkit.output import print_json

    built = random_model_dir(shape) if shape else None
    try:
        result = run_bench(
            str(built) if built else model,
            prompt=prompt or DEFAULT_PROMPT,
            max_tokens=max_tokens,
            max_depth=max_depth,
            trials=trials,
            progress=None if json_output else (lambda s: typer.echo(f"... {s}", err=True)),
        )
    finally:
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)
    if shape:
        result.model = f"random:{shape}"
    if json_output:
        print_json(result.to_json())
        return
    print_bench(result)


def main() -> None:
    app()
