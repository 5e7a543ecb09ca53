"""`mtpkit convert`: an MLX directory with the MTP head kept, or a head grafted into one."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from mtpkit.cli.options import (
    REMOTE_CODE_NOTE,
    Bits,
    BitsOpt,
    DtypeOpt,
    GroupSize,
    GroupSizeOpt,
    Hidden,
    JsonOpt,
    KeepMtpBf16Opt,
    LayoutOpt,
    MtpBitsOpt,
    QuantizeOpt,
    QuantMode,
    QuantModeOpt,
    QuantPredicate,
    QuantPredicateOpt,
    QuietOpt,
    RevisionOpt,
    SourceArg,
    TrustRemoteCodeOpt,
    friendly_errors,
    number,
    one_source,
    value,
)
from mtpkit.cli.values import among
from mtpkit.convert.recipes import recipe_names
from mtpkit.core.errors import MtpkitError
from mtpkit.publish.card import HUB_REPO

OutputOpt = Annotated[
    str | None,
    typer.Option("--output", "-o", "--mlx-path", metavar="DIR", help="The MLX directory to write."),
]
HfPathOpt = Annotated[
    str | None,
    typer.Option(
        "--hf-path",
        "--model",
        metavar="SOURCE",
        help="The same as SOURCE (mlx_lm.convert's spelling).",
    ),
]
HiddenOpt = Annotated[
    Hidden | None,
    typer.Option(
        "--hidden",
        **among(Hidden),
        help="Hidden state the head expects, recorded in the manifest: post_norm "
        "(default) or pre_norm.",
    ),
]
RecipeOpt = Annotated[
    str | None,
    typer.Option(
        "--recipe",
        metavar="RECIPE",
        help="A recipe: a .toml path or a name (" + ", ".join(recipe_names()) + "; a "
        "model's published name works too); flags override it. Without SOURCE, the model "
        "the recipe is written for is converted.",
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
ReplaceRepoOpt = Annotated[
    bool,
    typer.Option(
        "--replace-repo",
        help="With --upload-repo: replace the files the repo already holds (a model or an "
        "earlier mtpkit upload only; its history stays on the Hub).",
    ),
]
MtpOnlyOpt = Annotated[
    bool, typer.Option("--mtp-only", help="Graft only the MTP head (with --into).")
]
IntoOpt = Annotated[
    str | None,
    typer.Option("--into", metavar="DIR", help="The existing MLX directory to graft into."),
]
DraftVocabOpt = Annotated[
    int | None,
    typer.Option(
        "--draft-vocab",
        metavar="N",
        min=1,
        help="Let the MTP head draft over N token ids only (e.g. 32768): a cheaper draft step, "
        "the same output (the model still verifies over every token). The ids: the most "
        "frequent of --draft-vocab-corpus, else the tokenizer's id order (merge order for BPE).",
    ),
]
DraftVocabCorpusOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--draft-vocab-corpus",
        metavar="FILE",
        help="Text whose token counts choose the --draft-vocab ids: .txt (documents split by "
        "blank lines) or .jsonl (text, messages or prompt+completion); repeat for several.",
    ),
]
UploadRepoOpt = Annotated[
    str | None,
    typer.Option(
        "--upload-repo",
        metavar="ORG/NAME",
        help="Then publish the output as this Hub repo (org/name), in one commit with a model "
        "card, after `mtpkit check` passes on it (as mlx_lm.convert --upload-repo). The token "
        "and the repo are checked before converting; a repo that holds files is refused "
        "without --replace-repo.",
    ),
]


@friendly_errors
def convert_command(
    ctx: typer.Context,
    source: SourceArg = None,
    hf_path: HfPathOpt = None,
    output: OutputOpt = None,
    revision: RevisionOpt = None,
    quantize: QuantizeOpt = False,
    bits: BitsOpt = None,
    group_size: GroupSizeOpt = None,
    q_mode: QuantModeOpt = None,
    quant_predicate: QuantPredicateOpt = None,
    keep_mtp_bf16: KeepMtpBf16Opt = False,
    mtp_bits: MtpBitsOpt = None,
    dtype: DtypeOpt = None,
    layout: LayoutOpt = None,
    hidden: HiddenOpt = None,
    recipe: RecipeOpt = None,
    draft_vocab: DraftVocabOpt = None,
    draft_vocab_corpus: DraftVocabCorpusOpt = None,
    force: ForceOpt = False,
    mtp_only: MtpOnlyOpt = False,
    into: IntoOpt = None,
    upload_repo: UploadRepoOpt = None,
    replace_repo: ReplaceRepoOpt = False,
    quiet: QuietOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    json_output: JsonOpt = False,
    dequantize: Annotated[
        bool,
        typer.Option(
            "--dequantize", "-d",
            help="mlx_lm.convert's: not supported (mtpkit converts original checkpoints).",
        ),
    ] = False,
) -> None:
    """Convert a checkpoint to an MLX directory that stock mlx-lm loads, keeping its MTP head.

    The backbone is written as mlx_lm.convert writes it (same names, quantization modes, mixed recipes and dtypes); the head goes to mtp/weights.safetensors and every decision (norm shift, expert layout, quantization, source commit) to mtp/manifest.json. Without -q (or --q-bits, --q-mode, --quant-predicate) nothing is quantized; with it the head is quantized like the backbone unless --keep-mtp-bf16 or --mtp-bits says otherwise.

    With --draft-vocab N the head drafts over N token ids (mtp/draft_vocab.safetensors): a cheaper draft step, the same output.

    With --mtp-only --into DIR, only the head is read (on the Hub: its byte ranges) and added to an existing MLX conversion of the same model, quantized like it.

    Besides mtpkit's own record, the output carries what mlx-vlm, MTPLX, Rapid-MLX and vllm-mlx read to run the head (mtp.safetensors, config and manifest keys); --upload-repo publishes it with a model card saying how to run it in each.
    """
    from mtpkit.convert.grafting import graft
    from mtpkit.convert.pipeline import convert
    from mtpkit.core.console import log, warn

    if dequantize:
        raise MtpkitError(
            "convert --dequantize is not supported: mtpkit converts original checkpoints, whose "
            "weights are not quantized; convert the original repo, or dequantize an MLX "
            "directory with `mlx_lm.convert --dequantize` and graft its head with "
            "`mtpkit convert ORIGINAL --mtp-only --into DIR`"
        )
    if source is None and hf_path is None and recipe is not None and not mtp_only:
        source = _recipe_source(ctx, recipe)
    source = one_source(ctx, source, hf_path)
    quantizing = quantize or bits is not None or q_mode is not None or quant_predicate is not None
    _check_quantization(ctx, bits, group_size, q_mode, quant_predicate, keep_mtp_bf16, mtp_bits)
    if trust_remote_code:
        log(REMOTE_CODE_NOTE)
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
    if replace_repo and upload_repo is None:
        ctx.fail("--replace-repo applies to --upload-repo ORG/NAME: pass both")
    if draft_vocab_corpus and draft_vocab is None:
        ctx.fail("--draft-vocab-corpus chooses the ids of --draft-vocab N: pass both")
    if mtp_only:
        if draft_vocab is not None:
            ctx.fail("--draft-vocab is made when converting: pass it with -o DIR, not --mtp-only")
        if into is None or output is not None or quantizing or layout or recipe:
            ctx.fail(
                "--mtp-only takes --into DIR and only the head flags (--keep-mtp-bf16, "
                "--mtp-bits, --q-group-size, --dtype, --hidden, --force)"
            )
    else:
        _check_flags(ctx, output, into, quantizing or recipe is not None, group_size, mtp_bits)
    repo_state = None
    if upload_repo is not None:  # the token and the repo, before the conversion's minutes
        from mtpkit.publish.upload import preflight

        repo_state = preflight(
            upload_repo, source=source, replace=replace_repo, quiet=quiet or json_output
        )
    if mtp_only:
        result = graft(source, into=into, **common)
    else:
        if keep_mtp_bf16 and not quantizing and recipe is None:
            warn(
                "nothing is quantized without -q: --keep-mtp-bf16 only keeps the head "
                "in bfloat16 (float16 with --dtype float16)"
            )
        result = convert(
            source,
            output=output,
            quantize=quantize,
            bits=number(bits),
            mode=value(q_mode),
            quant_predicate=value(quant_predicate),
            layout=value(layout),
            recipe=recipe,
            draft_vocab=draft_vocab,
            draft_vocab_corpus=draft_vocab_corpus or (),
            **common,
        )
        if quantizing or recipe is not None:
            from mtpkit.convert.quant import cpu_scales_note

            note = cpu_scales_note(result.output)
            if note is not None:
                log(note)
    _publish_and_report(result, repo_state, replace_repo, quiet or json_output, json_output)


def _publish_and_report(
    result: Any, repo_state: Any, replace: bool, quiet: bool, json_output: bool
) -> None:
    """Warnings on stderr, the upload (`--upload-repo`), then the result on stdout."""
    from mtpkit.cli.commands.upload import published_line
    from mtpkit.cli.output import print_convert, print_json
    from mtpkit.core.console import log, warn

    for warning in result.warnings:
        warn(warning)
    published = None
    if repo_state is not None:
        from mtpkit.publish.upload import upload

        published = upload(
            result.output,
            repo_state.repo_id,
            replace=replace,
            state=repo_state,
            quiet=quiet,
            log=lambda line: log(f"... {line}"),
        )
    if json_output:
        print_json(result.to_json() | ({"upload": published} if published else {}))
        return
    print_convert(result)
    if published is not None:
        print(published_line(published), flush=True)


def _recipe_source(ctx: typer.Context, recipe: str) -> str:
    """The model a recipe is written for, when no SOURCE is given (`--recipe NAME -o OUT`)."""
    from mtpkit.convert.recipes import load_recipe
    from mtpkit.core.console import log

    repo = load_recipe(recipe).repo
    if not repo:
        ctx.fail(f"recipe {recipe} names no model ([model] repo): pass SOURCE")
    log(f"converting {repo}, the model recipe {recipe} is written for")
    return repo


def _check_quantization(
    ctx: typer.Context,
    bits: Bits | None,
    group_size: GroupSize | None,
    mode: QuantMode | None,
    predicate: QuantPredicate | None,
    keep_mtp_bf16: bool,
    mtp_bits: Bits | None,
) -> None:
    """Quantization flags that contradict each other are usage errors (exit 2)."""
    if keep_mtp_bf16 and mtp_bits is not None:
        ctx.fail("--keep-mtp-bf16 and --mtp-bits contradict each other: pass one")
    if predicate is not None and mode not in (None, QuantMode.affine):
        ctx.fail(
            f"--quant-predicate {predicate.value} supports only --q-mode affine (as in mlx-lm), "
            f"not {mode.value}"
        )
    if mode is not None or group_size is not None:
        from mtpkit.convert.quant import mode_problem

        problem = mode_problem(value(mode) or "affine", number(bits), number(group_size))
        if problem:
            ctx.fail(problem)


def _check_flags(
    ctx: typer.Context,
    output: str | None,
    into: str | None,
    quantizing: bool,
    group_size: GroupSize | None,
    mtp_bits: Bits | None,
) -> None:
    """Usage errors (exit 2) of a conversion's command line, before anything is read."""
    if into is not None:
        ctx.fail("--into DIR grafts a head: pass it with --mtp-only (or -o DIR to convert)")
    if output is None:
        ctx.fail("Missing option '-o' / '--output' (or --mtp-only --into DIR to graft a head).")
    if group_size is not None and not quantizing and mtp_bits is None:
        ctx.fail(
            "--q-group-size takes effect only when something is quantized: add -q "
            "(or --q-bits, --q-mode, --quant-predicate, --mtp-bits)"
        )
