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
from mtpkit.publish.card import HUB_REPO

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
UploadRepoOpt = Annotated[
    str | None,
    typer.Option(
        "--upload-repo",
        help="Then publish the output as this Hub repo (org/name), in one commit with a model "
        "card, after `mtpkit check` passes on it (as mlx_lm.convert --upload-repo).",
    ),
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
    upload_repo: UploadRepoOpt = None,
    quiet: QuietOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Convert a checkpoint to an MLX directory that stock mlx-lm loads, keeping its MTP head.

    The backbone is written as mlx_lm.convert writes it (same names, quantization and dtypes); the head goes to mtp/weights.safetensors and every decision (norm shift, expert layout, quantization, source commit) to mtp/manifest.json. Without --bits nothing is quantized; with --bits the head is quantized like the backbone unless --keep-mtp-bf16 or --mtp-bits says otherwise.

    With --mtp-only --into DIR, only the head is read (on the Hub: its byte ranges) and added to an existing MLX conversion of the same model, quantized like it.

    Besides mtpkit's own record, the output carries what mlx-vlm, MTPLX, Rapid-MLX and vllm-mlx read to run the head (mtp.safetensors, config and manifest keys); --upload-repo publishes it with a model card saying how to run it in each.
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
    if upload_repo is not None and not HUB_REPO.match(upload_repo):
        raise typer.BadParameter(f"{upload_repo!r} is not a Hub repo id (org/name)")
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
    published = None
    if upload_repo is not None:
        from mtpkit.publish.upload import upload

        published = upload(result.output, upload_repo, log=lambda line: log(f"... {line}"))
    if json_output:
        print_json(result.to_json() | ({"upload": published} if published else {}))
        return
    print_convert(result)
    if published is not None:
        acceptance = (published["check"] or {}).get("acceptance")
        checked = f", check pass, acceptance {acceptance:.1%}" if acceptance is not None else ""
        print(f"published {published['repo']} at {published['commit'][:12]}{checked}", flush=True)
