"""`mtpkit generate`: lossless speculative decoding with the model's own MTP head."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit.cli.options import (
    Hidden,
    JsonOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    friendly_errors,
    read_stdin_prompt,
    require_depth,
    value,
)
from mtpkit.core.errors import MtpkitError

MtpOpt = Annotated[
    bool | None,
    typer.Option(
        "--mtp/--no-mtp",
        help="--mtp: draft with the MTP head (an error without one); --mtp auto, or neither "
        "flag: use the head when there is one, else warn and decode plainly; --no-mtp: "
        "plain decoding (stock mlx-lm).",
    ),
]
# `--mtp auto` parses as the --mtp flag followed by this word.
MtpAutoArg = Annotated[str | None, typer.Argument(hidden=True, metavar="[auto]")]


@friendly_errors
def generate_command(
    model: Annotated[str, typer.Option("--model", "-m", help="A model directory or Hub repo id.")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt; - reads stdin.")],
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="Tokens to generate.")
    ] = 256,
    mtp: MtpOpt = None,
    mtp_mode: MtpAutoArg = None,
    depth: Annotated[
        int, typer.Option("--depth", help="Draft tokens per step, 1..4 (the head chained).")
    ] = 1,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: Annotated[int | None, typer.Option("--seed", help="Random seed for sampling.")] = None,
    hidden: Annotated[
        Hidden | None,
        typer.Option("--hidden", help="Hidden state fed to the head (default: the manifest's)."),
    ] = None,
    adaptive: Annotated[
        bool,
        typer.Option(
            "--adaptive/--no-adaptive",
            help="Pause drafting while it is slower than plain decoding.",
        ),
    ] = True,
    chat_template: Annotated[
        bool,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Apply the tokenizer's chat template, when it has one.",
        ),
    ] = True,
    json_output: JsonOpt = False,
) -> None:
    """Generate text, drafting tokens with the model's MTP head and verifying them losslessly.

    Greedy output is token for token the model's own (as stock mlx-lm's); at --temp > 0 exact rejection sampling keeps the model's distribution. Text streams to stdout; a summary goes to stderr.
    """
    import sys

    if mtp_mode not in (None, "auto") or (mtp_mode == "auto" and mtp is not True):
        raise MtpkitError(f"unexpected argument {mtp_mode!r}: the only word --mtp takes is 'auto'")
    mode: bool | str = "auto" if (mtp is None or mtp_mode == "auto") else mtp
    require_depth(depth)
    text = read_stdin_prompt() if prompt == "-" else prompt

    from mtpkit.cli.output import print_generate, print_json
    from mtpkit.spec.generate import generate

    def stream(segment: str) -> None:
        sys.stdout.write(segment)
        sys.stdout.flush()

    result = generate(
        model,
        text,
        max_tokens=max_tokens,
        mtp=mode,
        depth=depth,
        temp=temp,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        hidden=value(hidden),
        adaptive=adaptive,
        chat_template=chat_template,
        on_token=None if json_output else stream,
        warn=lambda message: typer.echo(f"Warning: {message}", err=True),
    )
    if json_output:
        print_json(result.to_json())
        return
    sys.stdout.write("\n")
    print_generate(result)
