"""The console: status lines and progress bars on stderr, the rich consoles of both streams.

Results go to stdout (`mtpkit.cli.output` prints them); everything else goes to stderr.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from rich.console import Console, ConsoleDimensions
from rich.text import Text

# Piped or logged output has no terminal width to fit; tables are laid out this wide there and
# their long cells wrap (`fold`), so a log stays readable and nothing in a row is cut.
PIPE_WIDTH = 120

# Characters that a terminal acts on rather than shows: C0 controls (ESC starts colour, title
# and screen-clearing sequences), DEL, C1 controls (0x9b is a one-byte CSI) and the Unicode
# bidirectional overrides that reorder what is shown. Tab and newline are layout, kept.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character written as its escape (`\\x1b`, `\\u202e`), as
    Python's repr writes it: names that came from a file (tensors, shards, model_type, a chat
    template's own error) reach the terminal as text, never as commands to it."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class WholeConsole(Console):
    """A rich console that escapes control characters in every string it prints (table cells
    included: `printable`), and, when not writing to a terminal (and COLUMNS is not set), lays
    tables out at PIPE_WIDTH; a terminal keeps its own width."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        return super().render_str(printable(text), **kwargs)

    def on_broken_pipe(self) -> None:
        # rich would exit 1 here; the reader went away, which `quiet_exit_on_closed_pipe` ends.
        raise BrokenPipeError

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        if self.is_terminal or self._width is not None or os.environ.get("COLUMNS"):
            return size
        return ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


# No markup: a tensor name such as `[/x]` is text, not a style (styles are given as `Text`).
stdout = WholeConsole(soft_wrap=True, markup=False)
stderr = WholeConsole(stderr=True, soft_wrap=True, markup=False)
# mtpkit's bars, as a huggingface_hub progress-bar group (`disable_progress_bars("mtpkit")`).
PROGRESS_GROUP = "mtpkit"


def progress_disabled(quiet: bool = False) -> bool:
    """Progress bars are off with --quiet, when stderr is not a terminal (a CI log gets no
    `\r` frames), or as huggingface_hub decides for its own bars
    (HF_HUB_DISABLE_PROGRESS_BARS=1, or `disable_progress_bars()` in Python)."""
    from huggingface_hub.utils import are_progress_bars_disabled

    return quiet or not is_terminal(sys.stderr) or are_progress_bars_disabled(PROGRESS_GROUP)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False


def progress_bar(total: int, *, desc: str, quiet: bool = False) -> Any:
    """A byte-counting bar on stderr (huggingface_hub's tqdm), or None when bars are off.

    The bar stays on screen when closed, showing the final count (100% once all is done)."""
    if progress_disabled(quiet):
        return None
    from huggingface_hub.utils import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=desc,
        file=sys.stderr,
        leave=True,
        name=PROGRESS_GROUP,
    )


# The shell's exit code for a writer ended by SIGPIPE (`yes | head -1`): 128 + 13.
CLOSED_PIPE_EXIT = 141


def closed_pipe_exit_code() -> int:
    """After a reader went away (`mtpkit inspect DIR | head -1`): points stdout (and stderr,
    when it is the closed one) at /dev/null, so nothing more is written or complained about on
    exit, and gives the exit code Unix tools end with there, as the Python docs advise
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    _to_devnull(sys.stdout)
    try:
        sys.stderr.flush()
    except (OSError, ValueError):  # `2>&1 | head`: stderr went with it
        _to_devnull(sys.stderr)
    return CLOSED_PIPE_EXIT


def _to_devnull(stream: Any) -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's stream)
        pass


def log(message: str) -> None:
    """A progress or status line on stderr (never on stdout, which holds the result)."""
    print(printable(message), file=sys.stderr, flush=True)


def warn(message: str) -> None:
    """A warning on stderr, one habit everywhere: `Warning: ...`, capitalised as Click's
    `Error: ...` and mlx-lm's `Warning:` lines (mlx-lm's generate also writes `[WARNING]`)."""
    log(f"Warning: {message}")


def step_bar(
    total: int, *, initial: int = 0, desc: str, quiet: bool = False, unit: str = "step"
) -> Any:
    """A counting bar on stderr (steps, whose postfix shows loss and held-out acceptance, or
    other `unit`s), or None when bars are off (`progress_disabled`)."""
    if progress_disabled(quiet):
        return None
    from huggingface_hub.utils import tqdm

    return tqdm(
        total=total,
        initial=initial,
        unit=unit,
        desc=desc,
        file=sys.stderr,
        leave=False,
        name=PROGRESS_GROUP,
    )


def quiet_libraries() -> None:
    """transformers' log lines and Python warnings (deprecations of config fields, model-type
    notices) stay off stderr, which holds mtpkit's own lines and at most one `Error:` line;
    MTPKIT_DEBUG=1 or TRANSFORMERS_VERBOSITY shows them again."""
    import os
    import warnings

    if os.environ.get("MTPKIT_DEBUG") == "1":
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers loads
    warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
    if "transformers" in sys.modules and os.environ["TRANSFORMERS_VERBOSITY"] == "error":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
