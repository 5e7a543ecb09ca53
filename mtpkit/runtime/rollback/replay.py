"""Rolling a verify pass back by replay, for caches the gated-delta-net capture does not cover
(one stream: `CacheReplay`; the rows of a batch, each to its own count: `RowsReplay`).

Some layers keep a state that cannot be trimmed and that `mtpkit.runtime.rollback.gdn` does not snapshot per
token: Kimi delta attention (Ling-3, `bailing_moe_v3`: three conv states and a recurrent
state), lightning attention (Ling-2.5/2.6, `bailing_hybrid`), and any other non-trimmable
cache. For those the caches' state before the verify pass is kept (MLX arrays are
immutable, so keeping references copies nothing); on a partial acceptance every cache goes
back to it (trimmable ones are trimmed to their pre-verify offset) and the backbone runs
again over the accepted prefix. A fully accepted round costs nothing extra; a partial one
costs one more backbone pass over the kept tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.rollback.gdn import gated_delta_net
from mtpkit.runtime.rollback.state import restore_state, saved_state


def is_trimmable(cache: Any) -> bool:
    return bool(getattr(cache, "is_trimmable", lambda: False)())


def gdn_covers(model: Any, caches: list[Any], is_recurrent: Callable[[Any], bool]) -> bool:
    """Whether every recurrent cache belongs to a gated-delta-net layer, whose per-token
    states `mtpkit.runtime.rollback.gdn` captures during a verify pass."""
    layers = list(getattr(model, "layers", []))
    if len(layers) != len(caches):
        return not any(is_recurrent(c) for c in caches)
    return all(
        not is_recurrent(cache) or gated_delta_net(layer) is not None
        for layer, cache in zip(layers, caches, strict=True)
    )


@dataclass
class CacheReplay:
    """The caches' state before one verify pass over `tokens`, and the forward that replays
    an accepted prefix."""

    tokens: mx.array  # [T]: the verify inputs
    saved: list[dict[str, Any] | None]  # per cache: its state, None for a trimmable one
    forward: Callable[[mx.array, list[Any]], Any]

    @classmethod
    def before(
        cls, caches: list[Any], tokens: mx.array, forward: Callable[[mx.array, list[Any]], Any]
    ) -> CacheReplay:
        return cls(tokens, [None if is_trimmable(c) else saved_state(c) for c in caches], forward)

    def rollback(self, caches: list[Any], kept: int) -> None:
        """Set the caches to their state after the first `kept` verify inputs only."""
        length = self.tokens.shape[0]
        if kept == length:
            return
        for cache, saved in zip(caches, self.saved, strict=True):
            if saved is None:
                cache.trim(length)
            elif hasattr(cache, "__dict__"):
                restore_state(cache, saved)
            else:
                name = type(cache).__name__
                raise MtpkitError(f"a {name} cannot drop rejected drafts: use --no-mtp")
        if kept > 0:
            out = self.forward(self.tokens[None, :kept], caches)
            mx.eval(out, [c.state for c in caches])


@dataclass
class RowsReplay:
    """The rows of a batch rolled back by replay: the caches' state before a pass over
    `tokens` [B, T] (None for a trimmable cache), and the forward that replays each row's
    kept prefix."""

    tokens: mx.array
    saved: list[Any]
    forward: Callable[[mx.array, list[Any]], Any]

    @classmethod
    def before(cls, caches: list[Any], tokens: mx.array, forward: Callable[..., Any]) -> RowsReplay:
        return cls(tokens, [None if is_trimmable(c) else saved_state(c) for c in caches], forward)

    def rollback(self, caches: list[Any], kept: list[int]) -> None:
        """Put every cache back to before the pass, then replay each row's kept prefix in
        segments between the distinct kept counts: in each, a row is either real for the
        whole segment or not at all. A row that is not has its KV entries right-padded out
        (`prepare`/`finalize`) and its recurrent states put back after the pass, so they
        stay exactly as they were (see `_replay_segment`)."""
        length = self.tokens.shape[1]
        for cache, saved in zip(caches, self.saved, strict=True):
            if saved is None:
                cache.trim(length)
            else:
                restore_state(cache, saved)
        start = 0
        for end in sorted(set(kept)):
            self._replay_segment(caches, start, end, [k >= end for k in kept])
            start = end

    def _replay_segment(self, caches: list[Any], start: int, end: int, real: list[bool]) -> None:
        """Replay verify positions [start, end) for the `real` rows. The others' recurrent
        states are put back rather than masked: mlx-lm's masks are not exact for every
        layer (nemotron_h's Mamba mixer masks the SSM's decay but not its input, so a padded
        last position dropped the row's kept tokens from its state)."""
        from mlx_lm.models.cache import ArraysCache

        from mtpkit.runtime.rollback.rows import leaves

        n = end - start
        padding = [0 if r else n for r in real]
        recurrent = [c for c in leaves(caches) if isinstance(c, ArraysCache)]
        before = [list(c.cache) for c in recurrent]
        for cache in caches:
            if not isinstance(cache, ArraysCache):
                cache.prepare(lengths=[n if r else 0 for r in real], right_padding=padding)
        out = self.forward(self.tokens[:, start:end], caches)
        for cache in caches:
            if not isinstance(cache, ArraysCache):
                cache.finalize()
        if not all(real):
            rows = mx.array(real)
            for cache, saved in zip(recurrent, before, strict=True):
                for i, (now, was) in enumerate(zip(cache.cache, saved, strict=True)):
                    if now is not None and was is not None:
                        keep = rows.reshape((-1,) + (1,) * (now.ndim - 1))
                        cache.cache[i] = mx.where(keep, now, was)
        mx.eval(out, [c.state for c in caches])
