"""`mtpkit bench`: plain decoding against MTP decoding at each depth."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit.cli.options import (
    JsonOpt,
    RandomShape,
    ScaleDtype,
    friendly_errors,
    require_depth,
    value,
)
from mtpkit.core.errors import MtpkitError


@friendly_errors
def bench_command(
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
    dtype: Annotated[
        ScaleDtype,
        typer.Option(
            "--dtype",
            help="With --random: the dtype of the quantization scales and unquantized weights "
            "(float32 runs ~10x faster on Linux CPUs; published 4-bit models carry bfloat16).",
        ),
    ] = ScaleDtype.float32,
    prompt: Annotated[str | None, typer.Option("--prompt", "-p", help="The prompt.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per run.")] = 128,
    max_depth: Annotated[int, typer.Option("--depth", help="Measure depths 1..K.")] = 3,
    trials: Annotated[
        int,
        typer.Option(
            "--trials", min=1, help="Interleaved trials; each figure is their median and range."
        ),
    ] = 5,
    draft_model: Annotated[
        str | None,
        typer.Option(
            "--draft-model",
            help="Also measure stock mlx-lm's speculative decoding with this separate draft "
            "model directory (same tokenizer), as one more row of the table.",
        ),
    ] = None,
    num_draft_tokens: Annotated[
        int,
        typer.Option("--num-draft-tokens", min=1, help="With --draft-model: drafts per step."),
    ] = 3,
    acceptance: Annotated[
        str | None,
        typer.Option(
            "--acceptance",
            help="SYNTHETIC figures: A[,B...] in [0, 1]. The head runs, but its draft at each "
            "depth is replaced, with probability A (seeded), by the backbone's own next token "
            "(from a greedy pass), else by a wrong one: what a head of that acceptance gains.",
        ),
    ] = None,
    json_output: JsonOpt = False,
) -> None:
    """Measure plain decoding (stock mlx-lm, --no-mtp) against MTP decoding at depths 1..K.

    Reports decode tok/s and acceptance per depth and with adaptive drafting, stock's ms per token in its own loop, each run's ms per step and the ceiling E*stock/step with the share realized; beta (a 2-token verify over a 1-token forward) and delta (a head step over it) as diagnostics: medians of interleaved trials with their range. A line on stderr (and "reliable": false) says when the trials are too few or their ranges too wide.

    With --draft-model DIR, one more row: stock mlx-lm's speculative decoding with that separate draft model (what LM Studio's mlx-engine offers), so the table shows whether the built-in head or a draft model is faster; models whose caches cannot be rolled back (Qwen3.5's gated delta nets) get the reason instead.
    """
    import shutil

    if (model is None) == (random_shape is None):
        raise MtpkitError("pass --model DIR or --random SHAPE")
    require_depth(max_depth)
    shape = value(random_shape)
    acceptances = parse_acceptances(acceptance)

    from mtpkit.bench.shapes import random_model_dir
    from mtpkit.bench.speed import DEFAULT_PROMPT, bench, print_bench
    from mtpkit.cli.output import print_json
    from mtpkit.core.console import log
    from mtpkit.runtime.model import library_io

    draft = None
    if draft_model is not None:
        from mtpkit.bench.draft import DraftModelBench

        log(f"... loading the draft model {draft_model}")
        draft = DraftModelBench(draft_model, num_draft_tokens)
    if shape:
        log(f"... building a random {shape} model ({dtype.value} scales)")
    with library_io():  # mlx-lm's "[INFO] Quantized model ..." goes to stderr, not stdout
        built = random_model_dir(shape, dtype.value) if shape else None
    try:
        result = bench(
            str(built) if built else model,
            prompt=prompt or DEFAULT_PROMPT,
            max_tokens=max_tokens,
            max_depth=max_depth,
            trials=trials,
            acceptances=acceptances,
            progress=lambda line: log(f"... {line}"),  # stderr, so also with --json
            draft=draft,
        )
    finally:
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)
    if shape:
        result.model = f"random:{shape}"
        result.dtype = dtype.value
    notes = result.reliability()
    if notes:
        log(f"warning: these figures mean little: {'; '.join(notes)}")
    if json_output:
        print_json(result.to_json())
        return
    print_bench(result)


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
