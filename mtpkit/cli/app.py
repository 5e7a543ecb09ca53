"""The `mtpkit` command line: the Typer app; each command lives in `mtpkit/cli/commands/`."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit import __version__
from mtpkit.cli.commands import (
    bench,
    chat,
    check,
    convert,
    generate,
    inspect,
    serve,
    train_head,
    upload,
)

app = typer.Typer(
    name="mtpkit",
    help="Keep, convert, run and check the multi-token-prediction (MTP) heads of open "
    "checkpoints on Apple's MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain forms: a usage error is two lines of usage and one `Error: ...` line
    # (exit 2), never a box; help is plain text that logs and pipes keep intact.
    rich_markup_mode=None,
    # -h as well as --help, as mlx-lm's commands take it.
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mtpkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Keep, convert, run and check the MTP heads of open checkpoints on MLX."""


# Each command function is named `<name>_command`, so that it never shadows the library
# function it calls (`convert_command` calls `mtpkit.convert.pipeline.convert`).
app.command(name="inspect")(inspect.inspect_command)
app.command(name="check")(check.check_command)
app.command(name="convert")(convert.convert_command)
app.command(name="generate", cls=generate.GenerateCommand, context_settings=generate.CONTEXT)(
    generate.generate_command
)
app.command(name="bench")(bench.bench_command)
app.command(name="serve")(serve.serve_command)
app.command(name="train-head")(train_head.train_head_command)
app.command(name="chat")(chat.chat_command)
app.command(name="upload")(upload.upload_command)


def main() -> None:
    """The program (`mtpkit.cli.entry.main`, the console script, adds the signal handling and
    the rank supervisor before these imports)."""
    from mtpkit.cli.entry import main as entry_main

    entry_main()
