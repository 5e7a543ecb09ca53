"""`mtpkit convert`: an MLX directory with the MTP head kept, or a head grafted into one."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit.cli.options import (
    BitsOpt,
    DtypeOpt,
    GroupSizeOpt,
    Hidden,
    JsonOpt,
    KeepMtpBf16Opt,
    LayoutOpt,
    MtpBitsOpt,
    RevisionOpt,
    SourceArg,
    friendly_errors,
    number,
    value,
)
from mtpkit.convert.recipes import recipe_names
from mtpkit.core.errors import MtpkitError

OutputOpt = Annotated[
    str | None, typer.Option("--output", "-o", help="The MLX directory to write.")
]
HiddenOpt = Annotated[
    Hidden | None,
    typer.Option(
        "--hidden",
        help="Hidden state the head expects, recorded in the manifest: post_norm "
        "(default) or pre_norm.",
    ),
]
RecipeOpt = Annotated[
    str | None,
    typer.Option(
        "--recipe",
        help="A recipe: a .toml path or a name (" + ", ".join(recipe_names()) + "; a "
        "model's published name works too); flags override it.",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace an existing output (with --mtp-only: an existing head). Never an "
        "output that is, holds or lies inside the source.",
    ),
]
MtpOnlyOpt = Annotated[
    bool, typer.Option("--mtp-only", help="Graft only the MTP head (with --into).")
]
IntoOpt = Annotated[
    str | None, typer.Option("--into", help="The existing MLX directory to graft into.")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]


@friendly_errors
def convert_command(
    source: SourceArg,
    output: OutputOpt = None,
    revision: RevisionOpt = None,
    bits: BitsOpt = None,
    group_size: GroupSizeOpt = None,
    keep_mtp_bf16: KeepMtpBf16Opt = False,
    mtp_bits: MtpBitsOpt = None,
    dtype: DtypeOpt = None,
    layout: LayoutOpt = None,
    hidden: HiddenOpt = None,
    recipe: RecipeOpt = None,
    force: ForceOpt = False,
    mtp_only: MtpOnlyOpt = False,
    into: IntoOpt = None,
    quiet: QuietOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Convert a checkpoint to an MLX directory that stock mlx-lm loads, keeping its MTP head.

    The backbone is written as mlx_lm.convert writes it (same names, quantization and dtypes); the head goes to mtp/weights.safetensors and every decision (norm shift, expert layout, quantization, source commit) to mtp/manifest.json. Without --bits nothing is quantized; with --bits the head is quantized like the backbone unless --keep-mtp-bf16 or --mtp-bits says otherwise.

    With --mtp-only --into DIR, only the head is read (on the Hub: its byte ranges) and added to an existing MLX conversion of the same model, quantized like it.
    """
    from mtpkit.cli.output import print_convert, print_json
    from mtpkit.convert.pipeline import convert, graft
    from mtpkit.core.console import log

    # The flags both paths take: how the head is stored, and how the run behaves.
    common = {
        "revision": revision,
        "keep_mtp_bf16": keep_mtp_bf16,
        "mtp_bits": number(mtp_bits),
        "group_size": number(group_size),
        "dtype": value(dtype),
        "hidden": value(hidden),
        "force": force,
        "quiet": quiet or json_output,
    }
    if mtp_only:
        if into is None or output is not None or bits is not None or layout or recipe:
            raise MtpkitError(
                "--mtp-only takes --into DIR and only the head flags "
                "(--keep-mtp-bf16, --mtp-bits, --group-size, --dtype, --hidden, --force)"
            )
        result = graft(source, into=into, **common)
    else:
        if output is None or into is not None:
            raise MtpkitError("pass -o OUT (or --mtp-only --into DIR to graft a head)")
        result = convert(
            source, output=output, bits=number(bits), layout=value(layout), recipe=recipe, **common
        )
    for warning in result.warnings:
        log(f"warning: {warning}")
    if json_output:
        print_json(result.to_json())
    else:
        print_convert(result)
