"""Discarding a whole verify pass that was queued on speculation.

A pipelined round is built and queued before the previous round's verdict is read, on the
premise that the previous round keeps all its drafts. When the verdict shows a rejection the
queued pass must leave no trace: `PassUndo.before` keeps, just before that pass, the state
of every cache that a trim cannot undo (sliding windows, gated-delta-net and other recurrent
states; new handles on the arrays' values, so this copies nothing), and `undo` trims the
plain KV caches and puts the others back. The previous round's own rollback
(`VerifyPass.rollback`) then runs as if the discarded pass had never been queued. A pass
built but not launched (`unlaunched`) keeps every cache's arrays, KV caches' too, so that
nothing of it is ever computed once it is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtpkit.runtime.rollback.replay import is_trimmable
from mtpkit.runtime.rollback.state import restore_state, saved_state
from mtpkit.runtime.rollback.window import is_rotating_cache


def trim_undoes(cache: Any) -> bool:
    """A cache whose growth a `trim` undoes exactly (not a sliding window)."""
    return is_trimmable(cache) and not is_rotating_cache(cache)


def _holds_caches(cache: Any) -> bool:
    """A cache whose state is other cache objects (mlx-lm's CacheList), changed in place."""
    values = vars(cache).values() if hasattr(cache, "__dict__") else []
    return any(
        hasattr(v, "update_and_fetch") or (isinstance(v, list) and v and hasattr(v[0], "state"))
        for v in values
    )


def can_discard(caches: list[Any]) -> bool:
    """Whether `PassUndo` can take back a pass over these caches (else rounds stay serial)."""
    for cache in caches:
        if trim_undoes(cache):
            continue
        if not hasattr(cache, "__dict__") or _holds_caches(cache):
            return False
    return True


@dataclass
class PassUndo:
    """What takes back one pass of `length` tokens over `caches` (see the module's text).

    `unlaunched`: the pass is built but not computed yet, and may never be: every cache's
    arrays are kept and put back, since a trim would leave the pass's writes in a KV
    buffer's lazy graph, to be computed with the next pass that reads that buffer."""

    length: int
    saved: list[dict[str, Any] | None]  # per cache: its state before the pass; None: trim

    @classmethod
    def before(cls, caches: list[Any], length: int, unlaunched: bool = False) -> PassUndo:
        return cls(
            length,
            [None if trim_undoes(c) and not unlaunched else saved_state(c) for c in caches],
        )

    def undo(self, caches: list[Any]) -> None:
        for cache, saved in zip(caches, self.saved, strict=True):
            if saved is None:
                cache.trim(self.length)
            else:
                restore_state(cache, saved)
