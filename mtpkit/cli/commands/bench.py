"""`mtpkit bench`: plain decoding against MTP decoding at each depth."""

from __future__ import annotations

import typer

from mtpkit.cli.options import (
    BenchDepthOpt,
    BenchMaxTokensOpt,
    BenchModelOpt,
    BenchPromptOpt,
    JsonOpt,
    RandomLayersOpt,
    RandomShapeOpt,
    ScaleDtypeOpt,
    TrialsOpt,
    friendly_errors,
    value,
)


@friendly_errors
def bench(
    ctx: typer.Context,
    model: BenchModelOpt = None,
    random_shape: RandomShapeOpt = None,
    random_layers: RandomLayersOpt = None,
    dtype: ScaleDtypeOpt = None,
    prompt: BenchPromptOpt = None,
    max_tokens: BenchMaxTokensOpt = 128,
    max_depth: BenchDepthOpt = 3,
    trials: TrialsOpt = 5,
    json_output: JsonOpt = False,
) -> None:
    """Measure plain decoding (stock mlx-lm, --no-mtp) against MTP decoding at depths 1..K.

    Reports decode tok/s and acceptance per depth and with adaptive drafting, beta (a 2-token verify over a 1-token forward), delta (a head step over a 1-token forward), the realized speedup and its ceiling (1+a)/(beta+delta): medians of interleaved trials with their range.
    """
    import shutil

    if (model is None) == (random_shape is None):
        ctx.fail("pass --model SOURCE or --random SHAPE (one of them)")
    if random_shape is None and (dtype is not None or random_layers is not None):
        flag = "--dtype" if dtype is not None else "--random-layers"
        ctx.fail(f"{flag} applies to the model --random builds: it has no effect with --model")
    if random_layers is not None and random_layers % 4:
        ctx.fail(f"--random-layers must be a multiple of 4 (3 linear, 1 full), not {random_layers}")
    shape = value(random_shape)
    scales = value(dtype) or "float32"

    from mtpkit.bench.shapes import random_model_dir
    from mtpkit.bench.speed import DEFAULT_PROMPT, print_bench
    from mtpkit.bench.speed import bench as run_bench
    from mtpkit.cli.output import print_json
    from mtpkit.core.console import log

    def progress(line: str) -> None:
        log(f"... {line}")  # stderr, so also with --json

    built = (
        random_model_dir(shape, scales, layers=random_layers, progress=progress) if shape else None
    )
    try:
        result = run_bench(
            str(built) if built else model,
            prompt=prompt or DEFAULT_PROMPT,
            max_tokens=max_tokens,
            max_depth=max_depth,
            trials=trials,
            progress=progress,
        )
    finally:
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)
    if shape:
        result.model = f"random:{shape}"
        result.dtype = scales
    if json_output:
        print_json(result.to_json())
        return
    print_bench(result)
