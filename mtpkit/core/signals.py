"""Termination signals get Ctrl-C's cleanup.

SIGTERM (what `timeout`, CI cancellation and `docker stop` send) and SIGHUP (a closed
terminal) raise `Interrupted`, a `KeyboardInterrupt`, in the main thread, so every cleanup that
runs on Ctrl-C runs on them too: a temporary output sibling removed, a graft's files left as
they were, check's scratch conversion deleted. The CLI turns any of them into one
`Error: interrupted by SIG...` line and the shell's exit code for the signal (128 + its number).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType

# Signals whose default is to die at once, without any cleanup. A signal the caller chose to
# ignore (`nohup` ignores SIGHUP) stays ignored.
TERMINATING = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class Interrupted(KeyboardInterrupt):
    """A termination signal, raised where Ctrl-C's KeyboardInterrupt would be."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum: int, frame: FrameType | None) -> None:
    # A second signal while the first one's cleanup runs would cut that cleanup short.
    for sig in TERMINATING:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def install() -> None:
    """Route SIGTERM and SIGHUP through Ctrl-C's path (main thread only, as Python requires)."""
    for sig in TERMINATING:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _raise)


def signal_number(interrupt: KeyboardInterrupt) -> int:
    return getattr(interrupt, "signum", signal.SIGINT)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's code for a run ended by this signal (130 for Ctrl-C, 143 for SIGTERM)."""
    return 128 + int(signal_number(interrupt))


def message(interrupt: KeyboardInterrupt) -> str:
    """The `Error:` line's text: which signal ended the run."""
    return f"interrupted by {signal.Signals(signal_number(interrupt)).name}"


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP until the block is done (a few renames that belong
    together): one that comes meanwhile is noted, and handled as it would have been right
    after the block. Outside the main thread (where Python runs no handler) nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, *TERMINATING)
    previous = {
        sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in held
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(caught[0])


# Daemon threads whose own workers Python joins at exit (a thread pool created inside them).
_POOL_OWNERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def owns_a_pool(thread: threading.Thread) -> None:
    """Mark a daemon thread whose work may start a thread pool (huggingface_hub's uploads):
    while it runs, a signal ends the process past it (`exit_now_if_workers_hang`)."""
    _POOL_OWNERS.add(thread)


def exit_now_if_workers_hang(code: int) -> None:
    """After a signal's cleanup, end the process with `code` at once if threads Python would
    wait for at exit are still running: non-daemon ones, and the workers of a thread pool
    (`concurrent.futures` joins them, daemon or not) stuck in a Hub request that never
    answers; otherwise a SIGTERM would not end the run."""
    main = threading.main_thread()
    busy = [
        t
        for t in threading.enumerate()
        if t is not main and t.is_alive() and (not t.daemon or t in _POOL_OWNERS)
    ]
    if not busy:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
