"""One verify pass and how it is undone: every cache kind rolled back to the accepted prefix.

KV caches are trimmed, sliding windows cut (`window`), gated-delta-net states restored from
the pass's own per-token snapshots (`gdn`), and caches neither covers replayed (`replay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.rollback.gdn import GdnSnapshots, is_recurrent_cache
from mtpkit.runtime.rollback.window import drop_rotating, is_rotating_cache


@dataclass
class VerifyPass:
    """One backbone pass over `[last token, drafts...]`, with what rolling it back needs."""

    logits: mx.array  # [1, T, V]
    hidden: mx.array  # [1, T, H]: the head's input after each verified token
    snapshots: GdnSnapshots | None
    length: int
    # Set when a non-trimmable cache is not a gated delta net's (`mtpkit.runtime.rollback.replay`).
    replay: Any = None

    def rollback(self, caches: list[Any], kept: int) -> None:
        """Keep the caches' state after the first `kept` verified tokens only."""
        if kept == self.length:
            return
        if self.replay is not None:
            self.replay.rollback(caches, kept)
            return
        recurrent = []
        for cache in caches:
            if is_recurrent_cache(cache):
                recurrent.append(cache)
            elif is_rotating_cache(cache):
                drop_rotating(cache, self.length - kept)
            elif cache.is_trimmable():
                cache.trim(self.length - kept)
            else:
                name = type(cache).__name__
                raise MtpkitError(f"a {name} cannot drop rejected drafts: use --no-mtp")
        if recurrent:
            self.snapshots.restore(recurrent, kept)
