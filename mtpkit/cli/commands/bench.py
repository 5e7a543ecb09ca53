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
    json_output: JsonOpt = False,
) -> None:
    """Measure plain decoding (stock mlx-lm, --no-mtp) against MTP decoding at depths 1..K.

    Reports decode tok/s and acceptance per depth and with adaptive drafting, beta (a 2-token verify over a 1-token forward), delta (a head step over a 1-token forward), the realized speedup and its ceiling (1+a)/(beta+delta): medians of interleaved trials with their range.

    With --draft-model DIR, one more row: stock mlx-lm's speculative decoding with that separate draft model (what LM Studio's mlx-engine offers), so the table shows whether the built-in head or a draft model is faster; models whose caches cannot be rolled back (Qwen3.5's gated delta nets) get the reason instead.
    """
    import shutil

    if (model is None) == (random_shape is None):
        raise MtpkitError("pass --model DIR or --random SHAPE")
    require_depth(max_depth)
    shape = value(random_shape)

    from mtpkit.bench.shapes import random_model_dir
    from mtpkit.bench.speed import DEFAULT_PROMPT, bench, print_bench
    from mtpkit.cli.output import print_json
    from mtpkit.core.console import log

    draft = None
    if draft_model is not None:
        from mtpkit.bench.draft import DraftModelBench

        log(f"... loading the draft model {draft_model}")
        draft = DraftModelBench(draft_model, num_draft_tokens)
    if shape:
        log(f"... building a random {shape} model ({dtype.value} scales)")
    built = random_model_dir(shape, dtype.value) if shape else None
    try:
        result = bench(
            str(built) if built else model,
            prompt=prompt or DEFAULT_PROMPT,
            max_tokens=max_tokens,
            max_depth=max_depth,
            trials=trials,
            progress=lambda line: log(f"... {line}"),  # stderr, so also with --json
            draft=draft,
        )
    finally:
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)
    if shape:
        result.model = f"random:{shape}"
        result.dtype = dtype.value
    if json_output:
        print_json(result.to_json())
        return
    print_bench(result)
