"""The console: status lines and progress bars on stderr, the rich consoles of both streams.

Results go to stdout (`mtpkit.cli.output` prints them); everything else goes to stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich.console import Console, ConsoleDimensions

# Piped or logged output has no width to fit: rich would assume 80 columns and cut tensor
# names and numbers with an ellipsis. Up to this width a table prints whole instead.
PIPE_WIDTH = 1000


class WholeConsole(Console):
    """A rich console that, when not writing to a terminal (and COLUMNS is not set), lays
    tables out at PIPE_WIDTH, so nothing in a row is cut; a terminal keeps its own width."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)  # type: ignore[attr-defined]
        if self.is_terminal or self._width is not None or os.environ.get("COLUMNS"):
            return size
        return ConsoleDimensions(PIPE_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


stdout = WholeConsole(soft_wrap=True)
stderr = WholeConsole(stderr=True, soft_wrap=True)
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


def log(message: str) -> None:
    """A progress or status line on stderr (never on stdout, which holds the result)."""
    print(message, file=sys.stderr, flush=True)


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
