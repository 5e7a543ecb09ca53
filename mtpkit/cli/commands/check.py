"""`mtpkit check`: the CI verdict on a checkpoint's MTP head."""

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
from mtpkit.cli.values import ranged


@friendly_errors
def check_command(
    ctx: typer.Context,
    source: SourceArg = None,
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    json_output: JsonOpt = False,
    junit: Annotated[
        str | None,
        typer.Option(
            "--junit",
            metavar="FILE",
            help="Also write a JUnit XML report to this file (for CI).",
            dir_okay=False,
        ),
    ] = None,
    min_acceptance: Annotated[
        float,
        typer.Option(
            "--min-acceptance",
            **ranged(float, min=0.0, max=1.0),
            metavar="X",
            help="Fail when greedy acceptance as shipped is below this.",
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
            metavar="FILE",
            help="Probe prompts: a JSON list of strings, or text with blank lines between prompts.",
            dir_okay=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens",
            "-m",
            **ranged(int, min=1),
            metavar="N",
            help="Tokens generated per probe prompt.",
        ),
    ] = 48,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            metavar="TARGET",
            help="The model a Gemma 4 assistant drafts for (checking an assistant).",
        ),
    ] = None,
) -> None:
    """Check an MTP checkpoint for CI: structure, quantization, manifest and acceptance.

    Structural checks read only config, index, manifest and headers. The probes generate greedily with the head, then re-run it with its norms shifted by -1 and +1, with the other hidden-state variant and with the other concat order, to name a double or missing norm shift or a mismatched convention with its fix.

    A Gemma 4 assistant is checked with its target (--target): its structure, the pairing, and the acceptance it reaches drafting for the target.

    On a CPU, bf16/fp16 MoE experts run in float32 (reported as moe_dtype). Exit 0 on pass, 3 on fail, 1 on an error.
    """
    from mtpkit.check.verdict import check_checkpoint
    from mtpkit.core.console import log

    spec = one_source(ctx, source, model)
    if target is not None or _is_assistant(spec, revision):
        from mtpkit.check.assistant import check_assistant
        from mtpkit.core.prompts import read_prompts

        result = check_assistant(
            spec, target=target, revision=revision, probe=probe,
            prompts=read_prompts(prompts) if prompts else None,
            min_acceptance=min_acceptance, max_tokens=max_tokens, log=log,
        )  # fmt: skip
        if junit is not None:
            from mtpkit.check.junit import write_junit

            write_junit(result, junit, spec)
        _print(result, json_output)
        return
    result = check_checkpoint(
        spec,
        revision=revision,
        probe=probe,
        prompts_file=prompts,
        min_acceptance=min_acceptance,
        max_tokens=max_tokens,
        junit=junit,
        log=log,
    )
    _print(result, json_output)


def _print(result: dict, json_output: bool) -> None:
    from mtpkit.cli.output import print_check, print_json

    if json_output:
        print_json(result)
    else:
        print_check(result)
    if result["verdict"] != "pass":
        raise typer.Exit(EXIT_FAILED_REQUIREMENT)


def _is_assistant(spec: str, revision: str | None) -> bool:
    """Whether `spec` is a Gemma 4 assistant (checked with its target, not as a head)."""
    from mtpkit.checkpoint.source import open_source
    from mtpkit.core.errors import MtpkitError
    from mtpkit.runtime.assistant import is_assistant

    try:
        config = open_source(spec, revision=revision).read_json("config.json")
    except (MtpkitError, OSError, ValueError):
        return False  # the head's check reports an unreadable source (and its --junit)
    return isinstance(config, dict) and is_assistant(config)
