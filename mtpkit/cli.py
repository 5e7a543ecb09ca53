"""The `mtpkit` command line: thin Typer commands over the library functions."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
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
        typer.Option("--junit", help="Also write a JUnit XML report to this file (for CI).", dir_okay=False),
    ] = None,
    min_acceptance: Annotated[
        float,
        typer.Option(
            "--min-acceptance", min=0.0, max=1.0, help="Fail when greedy acceptance as shipped is below this."
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
    from mtpkit.check import check_checkpoint, print_report, stderr_log, write_junit
    from mtpkit.output import print_json
    from mtpkit.prompts import read_prompts

    result = check_checkpoint(
        source,
        revision=revision,
        probe=probe,
        prompts=read_prompts(prompts) if prompts is not None else None,
        min_acceptance=min_acceptance,
        max_tokens=max_tokens,
        log=stderr_log,
    )
    if junit is not None:
        write_junit(result, junit)
    if json_output:
        print_json(result)
    else:
        print_report(result)
    if result["verdict"] != "pass":
        raise typer.Exit(EXIT_FAILED_REQUIREMENT)


@app.command()
@friendly_errors
def convert(
    source: SourceArg,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="The MLX directory to write.")
    ] = None,
    revision: RevisionOpt = None,
    bits: Annotated[
        int | None, typer.Option("--bits", help="Quantize to 2, 3, 4, 5, 6 or 8 bits (affine).")
    ] = None,
    group_size: Annotated[
        int | None, typer.Option("--group-size", help="Quantization group size: 32, 64 or 128.")
    ] = None,
    keep_mtp_bf16: Annotated[
        bool,
        typer.Option(
            "--keep-mtp-bf16",
            help="Leave every MTP tensor unquantized (float16 with --dtype float16, else bfloat16).",
        ),
    ] = False,
    mtp_bits: Annotated[
        int | None, typer.Option("--mtp-bits", help="Quantize the MTP head at this many bits.")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="bfloat16, float16 or float32 for unquantized weights."),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            "--layout",
            help="sidecar (default: head in mtp/) or inline (also in the model shards, "
            "Qwen3.5/3.6 only).",
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

    The backbone is written as mlx_lm.convert writes it; the head goes to mtp/weights.safetensors
    with every decision recorded in mtp/manifest.json. With --mtp-only --into DIR, only the head
    is read (on the Hub: its byte ranges) and added to an existing conversion.
    """
    from mtpkit.convert import convert as convert_checkpoint
    from mtpkit.convert import graft
    from mtpkit.output import print_json

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
            mtp_bits=mtp_bits,
            group_size=group_size,
            dtype=dtype,
            quiet=quiet or json_output,
        )
    else:
        if output is None or into is not None:
            raise MtpkitError("pass -o OUT (or --mtp-only --into DIR to graft a head)")
        result = convert_checkpoint(
            source,
            output=output,
            revision=revision,
            bits=bits,
            group_size=group_size,
            keep_mtp_bf16=keep_mtp_bf16,
            mtp_bits=mtp_bits,
            dtype=dtype,
            layout=layout,
            recipe=recipe,
            force=force,
            quiet=quiet or json_output,
        )
    if json_output:
        print_json(result.as_dict())
    else:
        typer.echo(
            f"wrote {result.output}: {result.family}, {result.backbone_tensors} backbone and "
            f"{result.head_tensors} MTP tensors in {result.seconds:.1f}s"
        )


def main() -> None:
    app()
