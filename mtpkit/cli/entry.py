"""The `mtpkit` program's entry point, kept light: termination signals are routed through
Ctrl-C's cleanup (`mtpkit.core.signals`) before the command line's imports begin, so a Ctrl-C
or SIGTERM in the first moments is one `Error:` line too, never a traceback."""

from __future__ import annotations

import os
import sys


def main() -> None:
    try:
        from mtpkit.core import signals

        signals.install()
        from mtpkit.cli.ranks import supervise_rank

        # One rank of `mlx.launch`: the command runs in a supervised child, so that a rank
        # MLX's ring backend crashes is still one `Error:` line (`mtpkit.cli.ranks`).
        code = supervise_rank(sys.argv[1:])
        if code is not None:
            raise SystemExit(code)
        from mtpkit.cli.app import app
        from mtpkit.cli.ranks import CHILD_MARK

        # Typer builds the Click command before Click's own Ctrl-C handling starts. A rank's
        # child runs as `python -m mtpkit`, which its usage lines would otherwise say.
        try:
            if os.environ.get(CHILD_MARK):
                app(prog_name="mtpkit")
            else:
                app()
        except SystemExit as e:
            interrupt = _interrupt_behind(e)
            if interrupt is not None:  # Typer turned it into a silent exit 130
                raise interrupt from None
            if isinstance(e.code, int) and e.code >= 128:  # a signal ended the command
                signals.exit_now_if_workers_hang(e.code)
            raise
    except KeyboardInterrupt as e:
        from mtpkit.core import signals

        print(f"Error: {signals.message(e)}", file=sys.stderr, flush=True)
        raise SystemExit(signals.exit_code(e)) from None
    except BrokenPipeError:  # help or usage text to a reader that went away (`| head -1`)
        from mtpkit.core.console import closed_pipe_exit_code

        raise SystemExit(closed_pipe_exit_code()) from None


def _interrupt_behind(exit: SystemExit) -> KeyboardInterrupt | None:
    """The Ctrl-C or SIGTERM that Typer answered with a bare exit 130 (a signal during its
    start-up, before the command's own handling: `raise Exit(130) from interrupt`, then
    `sys.exit`): it is then one `Error:` line and the signal's own code, like a signal at
    any other moment."""
    from typer import Exit

    typer_exit = exit.__context__
    if exit.code == 130 and isinstance(typer_exit, Exit):
        cause = typer_exit.__cause__
        return cause if isinstance(cause, KeyboardInterrupt) else None
    return None
