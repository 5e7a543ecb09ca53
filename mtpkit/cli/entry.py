"""The `mtpkit` program's entry point, kept light: termination signals are routed through
Ctrl-C's cleanup (`mtpkit.core.signals`) before the command line's imports begin, so a Ctrl-C
or SIGTERM in the first moments is one `Error:` line too, never a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from mtpkit.core import signals

        signals.install()
        from mtpkit.cli.app import app

        # Typer builds the Click command before Click's own Ctrl-C handling starts.
        app()
    except KeyboardInterrupt as e:
        from mtpkit.core import signals

        print(f"Error: {signals.message(e)}", file=sys.stderr, flush=True)
        raise SystemExit(signals.exit_code(e)) from None
