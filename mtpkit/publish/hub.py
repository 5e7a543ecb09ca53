"""The Hub client as uploads use it: every request bounded in time, bars only on a terminal,
and the client's work off the main thread.

huggingface_hub's shared HTTP client has no timeout (`timeout=None`), and some calls pass
`None` explicitly, so a Hub that stops answering would hang an upload for ever. A request hook
sets each request's limits (`MTPKIT_HUB_TIMEOUT` seconds, 120 by default, for connecting,
each read and each write; huggingface_hub retries a timed-out LFS upload a few times). The
client's calls run in a daemon thread while the main thread waits where a signal reaches it:
an LFS upload's thread pool would otherwise hold the main thread in its exit until every
request ended (the CLI then ends the process past such workers,
`mtpkit.core.signals.exit_now_if_workers_hang`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from mtpkit.core.signals import owns_a_pool

TIMEOUT_VARIABLE = "MTPKIT_HUB_TIMEOUT"
DEFAULT_TIMEOUT = 120.0
T = TypeVar("T")


def request_timeout() -> float:
    """Seconds a Hub request may wait for each step (`MTPKIT_HUB_TIMEOUT`, checked at start
    by `mtpkit.core.environment`)."""
    value = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    return float(value) if value else DEFAULT_TIMEOUT


@contextmanager
def bounded_requests(seconds: float) -> Iterator[None]:
    """Every request of the shared huggingface_hub client in the block waits at most
    `seconds` to connect, and for each read and write."""
    from huggingface_hub import get_session

    limits = {"connect": seconds, "read": seconds, "write": seconds, "pool": seconds}

    def bound(request: Any) -> None:
        request.extensions["timeout"] = dict(limits)

    hooks = get_session().event_hooks["request"]
    hooks.append(bound)
    try:
        yield
    finally:
        if bound in hooks:
            hooks.remove(bound)


def on_the_hub(work: Callable[[], T], *, quiet: bool = False) -> T:
    """`work()` (calls of the Hub client) with requests bounded (`bounded_requests`) and
    progress bars only on a terminal and never `quiet`, run in a daemon thread while the
    main thread waits; its result, or its exception raised here."""
    from mtpkit.checkpoint.source import hub_progress

    outcome: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread as it is
            outcome["error"] = e
        finally:
            finished.set()

    with bounded_requests(request_timeout()), hub_progress(quiet=quiet):
        thread = threading.Thread(target=run, name="mtpkit-hub", daemon=True)
        owns_a_pool(thread)
        thread.start()
        # A signal's handler runs here and its exception ends the wait (not `join`: a join
        # a signal interrupts can leave the thread marked as stopped while it still runs).
        finished.wait()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


__all__ = ["bounded_requests", "on_the_hub", "request_timeout"]
