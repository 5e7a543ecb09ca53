"""`mtpkit inspect`: a checkpoint's MTP head from its JSON files and headers."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit.cli.options import (
    EXIT_FAILED_REQUIREMENT,
    JsonOpt,
    ModelOpt,
    RevisionOpt,
    SourceArg,
    friendly_errors,
    one_source,
)


@friendly_errors
def inspect_command(
    ctx: typer.Context,
    source: SourceArg = None,
    model: ModelOpt = None,
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
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            metavar="MODEL",
            help="With a block drafter (DFlash, EAGLE-3): the target model to check it against.",
        ),
    ] = None,
) -> None:
    """Report a checkpoint's MTP head from its config, index and safetensors headers.

    Reads no weights: on the Hub only the JSON files and a few kilobytes per shard are fetched.

    Also says how the head is stored (mtpkit's sidecar, inline, a raw checkpoint, vllm-mlx's or MTPLX's sidecars, an mlx-vlm drafter directory) and which runtimes run the directory, with its head or plainly (mlx-lm, mtpkit, mlx-vlm, MTPLX, Rapid-MLX, vllm-mlx, LM Studio).

    A block drafter's directory (DFlash, EAGLE-3) is reported as a drafter: its target, the target layers it reads, its block size and mask token (DFlash) or its draft vocabulary and d2t map (EAGLE-3), and its problems (with --target: whether it drafts for that model).

    Exit 0 when the checkpoint could be read (problems are listed, not fatal), 3 with --require-mtp when the head is not usable, 1 on an error.
    """
    from mtpkit.checkpoint.report import head_state, inspect_checkpoint
    from mtpkit.cli.output import print_inspect, print_json

    result = inspect_checkpoint(one_source(ctx, source, model), revision=revision, target=target)
    if json_output:
        print_json(result)
    elif "drafter" in result:
        from mtpkit.cli.drafter_output import print_drafter

        print_drafter(result)
    else:
        print_inspect(result, show_tensors=tensors)
    if require_mtp and head_state(result) != "ok":
        raise typer.Exit(EXIT_FAILED_REQUIREMENT)
