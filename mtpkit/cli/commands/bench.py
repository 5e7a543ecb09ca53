"""`mtpkit bench`: plain decoding against MTP decoding at each depth."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mtpkit.cli.commands.bench_serve import (
    ClientsOpt,
    LongPromptOpt,
    MlxLmArgsOpt,
    RoundsOpt,
    ServeArgsOpt,
    ServeOpt,
    run_serve_bench,
    serve_acceptance,
)
from mtpkit.cli.options import (
    BenchDepthOpt,
    BenchMaxTokensOpt,
    BenchModelOpt,
    BenchPromptOpt,
    JsonOpt,
    PipelineOpt,
    PromptLookupOpt,
    RandomLayersOpt,
    RandomShapeOpt,
    ScaleDtypeOpt,
    TimeoutOpt,
    TrialsOpt,
    friendly_errors,
    value,
)
from mtpkit.cli.ranks import DEFAULT_TIMEOUT, command_facts, on_ranks

if TYPE_CHECKING:
    from mtpkit.speculative.proposers.choose import DrafterChoice

DEFAULT_DRAFTS = 3  # a draft model's drafts per step without --num-draft-tokens

DraftModelOpt = Annotated[
    str | None,
    typer.Option(
        "--draft-model",
        metavar="DIR",
        help="Also measure drafting with this separate draft model (same tokenizer): "
        "mtpkit's row, and stock mlx-lm's speculative decoding with it where stock runs it.",
    ),
]
NumDraftTokensOpt = Annotated[
    str | None,
    typer.Option(
        "--num-draft-tokens",
        metavar="N[,M...]",
        help="With --draft-model: drafts per step (default 3). With a block drafter (a DFlash "
        "or EAGLE-3 --draft-model, or a --random qwen3 shape): also a row at each N, with "
        "its round's cost (verify of N+1 tokens + one drafter pass) in 1-token forwards.",
    ),
]
PromptTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--prompt-tokens",
        min=1,
        metavar="N",
        help="Decode after a context of N tokens: the prompt repeated to N tokens (with "
        "--random: N random token ids).",
    ),
]
AcceptanceOpt = Annotated[
    str | None,
    typer.Option(
        "--acceptance",
        metavar="A[,B...]",
        help="SYNTHETIC figures: A[,B...] in [0, 1]. The head (or a block drafter) runs, but "
        "its draft at each depth is replaced, with probability A (seeded), by the backbone's "
        "own next token (from a greedy pass), else by a wrong one: what a head of that "
        "acceptance gains. With --serve: one value, mtpkit serve --oracle-acceptance A.",
    ),
]
BatchOpt = Annotated[
    str | None,
    typer.Option(
        "--batch",
        metavar="B[,C...]",
        help="Measure batched decoding instead: at each width, B requests of the prompt (or "
        "of the prompts, in turn) decoded together, MTP (depth 1, each row accepting on its "
        "own) against stock mlx-lm's batch_generate at the same width (with --acceptance: "
        "oracle drafts per row; with --prompt-tokens: each prompt made that long).",
    ),
]
DraftVocabOpt = Annotated[
    int | None,
    typer.Option(
        "--draft-vocab",
        metavar="N",
        min=1,
        help="With --random: the head drafts over the first N token ids, as `convert "
        "--draft-vocab N` makes it (a model of your own: convert it with --draft-vocab).",
    ),
]


@friendly_errors
def bench_command(
    ctx: typer.Context,
    model: BenchModelOpt = None,
    random_shape: RandomShapeOpt = None,
    random_layers: RandomLayersOpt = None,
    dtype: ScaleDtypeOpt = None,
    prompt: BenchPromptOpt = None,
    prompt_tokens: PromptTokensOpt = None,
    max_tokens: BenchMaxTokensOpt = 128,
    max_depth: BenchDepthOpt = 3,
    trials: TrialsOpt = 5,
    draft_model: DraftModelOpt = None,
    num_draft_tokens: NumDraftTokensOpt = None,
    acceptance: AcceptanceOpt = None,
    prompt_lookup: PromptLookupOpt = False,
    json_output: JsonOpt = False,
    pipeline: PipelineOpt = False,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
    batch: BatchOpt = None,
    draft_vocab: DraftVocabOpt = None,
    serve: ServeOpt = False,
    clients: ClientsOpt = "1,2,4,8,16,32",
    rounds: RoundsOpt = 2,
    long_prompt_tokens: LongPromptOpt = 1024,
    serve_args: ServeArgsOpt = "",
    mlx_lm_args: MlxLmArgsOpt = "",
) -> None:
    """Measure plain decoding (stock mlx-lm, --no-mtp) against MTP decoding at depths 1..K.

    Reports decode tok/s and acceptance per depth and with adaptive drafting, stock's ms per token in its own loop, each run's ms per step and the ceiling E*stock/step with the share realized; beta (a 2-token verify over a 1-token forward) and delta (a head step over it) as diagnostics: medians of interleaved trials with their range, and stock against itself (each stock run inside a trial over the ones around it: the noise every speedup carries). A line on stderr (and "reliable": false) says when the trials are too few or their ranges, stock's against itself included, too wide.

    With --serve, mtpkit serve against mlx_lm.server on the same directory, many clients at once (see --clients); with --random, on the random model with its random head; with --acceptance A, SYNTHETIC: mtpkit serve drafts with oracle drafts at acceptance A (mtpkit serve --oracle-acceptance).

    With --draft-model DIR, two more rows: mtpkit drafting with that separate draft model, and stock mlx-lm's speculative decoding with it (what LM Studio's mlx-engine offers), so the table shows whether the built-in head or a draft model is faster; where stock cannot roll the caches back (Qwen3.5's gated delta nets) its row gets the reason instead. With --prompt-lookup, one more row: mtpkit drafting by prompt lookup. A model without a head gets only these rows.

    A block drafter (DFlash, EAGLE-3) gets an adaptive row and one at each --num-draft-tokens N; with --acceptance its blocks are oracle blocks (its pass runs, its drafts are replaced per position). --random qwen3-4b and qwen3-8b (Qwen3 dense, no head) are drafted by a random DFlash drafter of the published shape (5 layers, block 16).
    """
    import shutil

    if (model is None) == (random_shape is None):
        ctx.fail("pass --model SOURCE or --random SHAPE (one of them)")
    if random_shape is None and (dtype is not None or random_layers is not None):
        flag = "--dtype" if dtype is not None else "--random-layers"
        ctx.fail(f"{flag} applies to the model --random builds: it has no effect with --model")
    if draft_vocab is not None and random_shape is None:
        ctx.fail("--draft-vocab applies to --random: convert your model with --draft-vocab N")
    shape = value(random_shape)
    depths, block = _drafter_depths(ctx, shape, random_layers, draft_model, num_draft_tokens,
                                    serve or batch is not None, draft_vocab)  # fmt: skip
    scales = value(dtype) or "float32"
    acceptances = parse_acceptances(acceptance)
    widths = parse_widths(batch)
    if widths is not None and draft_model is not None and prompt_lookup:
        ctx.fail("--draft-model and --prompt-lookup are two drafters: --batch takes one")
    if widths is not None and (prompt_lookup or draft_model is not None) and acceptances:
        flag = "--prompt-lookup" if prompt_lookup else "--draft-model"
        ctx.fail(f"--acceptance replaces the head's drafts: --batch {flag} takes none")
    if serve and (widths is not None or draft_model or prompt_lookup):
        ctx.fail("--serve takes none of --batch, --draft-model, --prompt-lookup")
    levels = parse_widths(clients, "--clients") if serve else None
    oracle = serve_acceptance(acceptances, serve_args) if serve else None
    prompts = prompt or [None]
    if widths is None and len(prompts) > 1:
        ctx.fail("several --prompt are the rows of --batch: a single stream takes one")

    from mtpkit.bench.random_drafter import random_drafter
    from mtpkit.bench.shapes import random_model_dir
    from mtpkit.bench.speed import DEFAULT_PROMPT
    from mtpkit.core.console import log
    from mtpkit.runtime.model import library_io

    def progress(line: str) -> None:
        log(f"... {line}")  # stderr, so also with --json

    from mtpkit.speculative.proposers.choose import DrafterChoice

    drafters = [DrafterChoice(draft_model=draft_model)] if draft_model is not None else []
    drafters += [DrafterChoice(prompt_lookup=True)] if prompt_lookup else []
    draft = None
    if draft_model is not None and not _mtpkit_only(draft_model):
        # Stock mlx-lm's row: it cannot load a Gemma 4 assistant or a block drafter (mtpkit's
        # row alone then).
        from mtpkit.bench.draft import DraftModelBench

        progress(f"loading the draft model {draft_model}")
        draft = DraftModelBench(draft_model, depths[0] if depths else DEFAULT_DRAFTS)
    with library_io():  # mlx-lm's "[INFO] Quantized model ..." goes to stderr, not stdout
        built = (
            random_model_dir(
                shape, scales, layers=random_layers, progress=progress, draft_vocab=draft_vocab
            )
            if shape
            else None
        )
    if built is not None and (drafter := random_drafter(built)) is not None:
        drafters = [DrafterChoice(draft_model=drafter), *drafters]
    if levels is not None:
        try:
            run_serve_bench(
                str(built) if built else model, levels, rounds=rounds, max_tokens=max_tokens,
                long_prompt_tokens=long_prompt_tokens, serve_args=serve_args,
                mlx_lm_args=mlx_lm_args, json_output=json_output, progress=progress,
                name=f"random:{shape}" if shape else None, acceptance=oracle,
            )  # fmt: skip
        finally:
            if built is not None:
                shutil.rmtree(built.parent, ignore_errors=True)
        return
    if widths is not None:
        _bench_batch(
            str(built) if built else model, widths, [p or DEFAULT_PROMPT for p in prompts],
            prompt_tokens, max_tokens, trials, acceptances, json_output, progress,
            f"random:{shape}" if shape else None,
            DrafterChoice(draft_model=draft_model, prompt_lookup=prompt_lookup),
        )  # fmt: skip
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)
        return
    _bench_stream(
        ctx, str(built) if built else model, built, shape, scales, prompts[0] or DEFAULT_PROMPT,
        prompt_tokens, max_tokens, max_depth, trials, acceptances, progress, pipeline, draft,
        drafters, depths, block, json_output, timeout,
    )  # fmt: skip


def _bench_stream(
    ctx: typer.Context, target: str, built: Path | None, shape: str | None, scales: str,
    prompt: str, prompt_tokens: int | None, max_tokens: int, max_depth: int, trials: int,
    acceptances: list[float] | None, progress: Callable[[str], None], pipeline: bool,
    draft: Any, drafters: list[DrafterChoice], depths: list[int] | None, block: bool,
    json_output: bool, timeout: float,
) -> None:  # fmt: skip
    """One stream's bench on `target` (on ranks under mlx.launch: rank 0 prints); `built`,
    a random model's directory, is removed after."""
    import shutil

    from mtpkit.bench.speed import bench, print_bench
    from mtpkit.cli.output import print_json
    from mtpkit.core.console import warn

    try:
        facts = command_facts(ctx, per_rank=("model", "json_output", "timeout"))
        with on_ranks(timeout, facts, model=target) as ranks:  # under mlx.launch: rank 0 prints
            result = bench(
                target,
                prompt=prompt,
                prompt_tokens=prompt_tokens,
                synthetic=shape is not None,
                max_tokens=max_tokens,
                max_depth=max_depth,
                trials=trials,
                acceptances=acceptances,
                progress=progress if ranks.is_root else None,
                pipeline=pipeline,
                draft=draft,
                drafters=drafters,
                num_draft_tokens=depths[0] if depths and not block else DEFAULT_DRAFTS,
                block_depths=depths if depths and block else (),
            )
    finally:
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)
    if not ranks.is_root:
        return
    if shape:
        result.model = f"random:{shape}"
        result.dtype = scales
    notes = result.reliability()
    if notes:
        warn(f"these figures mean little: {'; '.join(notes)}")
    if json_output:
        print_json(result.to_json())
        return
    print_bench(result)


def _bench_batch(
    model: str,
    widths: list[int],
    prompts: list[str],
    prompt_tokens: int | None,
    max_tokens: int,
    trials: int,
    acceptances: list[float] | None,
    json_output: bool,
    progress: Callable[[str], None],
    name: str | None,
    drafter: DrafterChoice | None = None,
) -> None:
    from mtpkit.bench.batch import bench_batch, print_batch_bench
    from mtpkit.cli.output import print_json
    from mtpkit.core.console import warn

    result = bench_batch(
        model, widths=widths, prompts=prompts, prompt_tokens=prompt_tokens,
        synthetic=name is not None, max_tokens=max_tokens, trials=trials,
        acceptances=acceptances, progress=progress,
        drafter=drafter,
    )  # fmt: skip
    if name is not None:
        result.model = name
    notes = result.reliability()
    if notes:
        warn(f"these figures mean little: {'; '.join(notes)}")
    if json_output:
        print_json(result.to_json())
    else:
        print_batch_bench(result)


def parse_widths(text: str | None, flag: str = "--batch") -> list[int] | None:
    """`--batch 1,2,4,8` as positive ints (a bad list is a command-line error)."""
    if text is None:
        return None
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise typer.BadParameter(
            f"takes positive integers separated by commas, not {text!r}", param_hint=flag
        )
    return values


def parse_acceptances(text: str | None) -> list[float] | None:
    """`--acceptance 0,0.8,0.9` as floats in [0, 1] (a bad list is a command-line error)."""
    if text is None:
        return None
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise typer.BadParameter(
            f"takes numbers in [0, 1] separated by commas, not {text!r}",
            param_hint="--acceptance",
        )
    return values


def _drafter_depths(
    ctx: typer.Context, shape: str | None, random_layers: int | None, draft_model: str | None,
    num_draft_tokens: str | None, not_single: bool, draft_vocab: int | None,
) -> tuple[list[int] | None, bool]:  # fmt: skip
    """`--num-draft-tokens` as ints, and whether a block drafter drafts (a DFlash or EAGLE-3
    --draft-model, or the random drafter of a --random shape without a head); what cannot
    be honoured is a command-line error."""
    from mtpkit.bench.shapes import has_head

    headless = shape is not None and not has_head(shape)
    if headless and draft_vocab is not None:
        ctx.fail(f"--draft-vocab subsets an MTP head's vocabulary: --random {shape} has no head")
    if random_layers is not None and random_layers % 4 and not headless:
        ctx.fail(f"--random-layers must be a multiple of 4 (3 linear, 1 full), not {random_layers}")
    if headless and (draft_model is not None or not_single):
        flag = "--draft-model" if draft_model is not None else "--serve and --batch"
        ctx.fail(f"--random {shape} drafts with its own random DFlash drafter, a single "
                 f"stream: it takes no {flag}")  # fmt: skip
    depths = parse_widths(num_draft_tokens, "--num-draft-tokens")
    if depths is not None and not_single:
        ctx.fail("--num-draft-tokens sets single-stream rows: --serve and --batch take none")
    block = headless or (draft_model is not None and _block_drafter(draft_model))
    if depths is not None and not block and (draft_model is None or len(depths) > 1):
        ctx.fail("--num-draft-tokens takes one N with --draft-model (a list: a block drafter's "
                 "rows) and applies to a drafter only")  # fmt: skip
    return depths, block


def _mtpkit_only(spec: str) -> bool:
    """A drafter stock mlx-lm cannot load: a Gemma 4 assistant, a block drafter."""
    from mtpkit.runtime.assistant import assistant_directory

    return assistant_directory(spec) is not None or _block_drafter(spec)


def _block_drafter(spec: str) -> bool:
    from mtpkit.checkpoint.drafters import block_drafter

    return block_drafter(spec) is not None
