"""`mtpkit bench`: plain decoding against MTP decoding at each depth."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit.errors import MtpkitError
from mtpkit.options import JsonOpt, RandomShape, friendly_errors, require_depth, value


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
    require_depth(max_depth)
    shape = value(random_shape)

    from mtpkit.bench import DEFAULT_PROMPT, print_bench, random_model_dir
    from mtpkit.bench import bench as run_bench
    from mtpkit.output import log, print_json

    built = random_model_dir(shape) if shape else None
    try:
        result = run_bench(
            str(built) if built else model,
            prompt=prompt or DEFAULT_PROMPT,
            max_tokens=max_tokens,
            max_depth=max_depth,
            trials=trials,
            progress=lambda line: log(f"... {line}"),  # stderr, so also with --json
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
