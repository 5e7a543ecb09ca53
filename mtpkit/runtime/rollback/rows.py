"""Rolling the rows of a batch back, each to its own kept prefix, one dispatch per cache kind
(`rollback_rows`): the per-row side of `verify_pass`'s one-row rollback.

The rows of a batch share one pass over `[B, T]` tokens but keep different counts. mlx-lm's
batched caches hold the rows left-aligned on one write index (`BatchKVCache`: per-row
`offset` and `left_padding`, the mask hides each row's padding), so one `trim` cannot drop
different tails. Here every KV cache is trimmed by the fewest rejected tokens of any row, and
a row that rejected more is rolled right by the rest (`drop_per_row`): its rejected entries
leave the visible window and its left padding grows by as much, as mlx-lm's own
`BatchKVCache.finalize` turns a right-padded prompt into a left-padded one. Its `offset` (the
RoPE position) drops by the same count, so its next tokens get the positions a single stream
would give them. With the counts still on the device (a round built before the one before it
is read) every row is rolled and nothing trimmed (`roll_per_row`).

A sliding window (`BatchRotatingKVCache`) is rolled back the same way: a pass of several
tokens leaves it in temporal order, so its common tail is cut off the buffer (mlx-lm's `trim`
only moves the write index, and a one-token step, a plain batched step, keeps the buffer's
last `window` entries, rejected ones included: as `window` cuts one stream's), then rows are
rolled. Gated-delta-net layers take each row's state after its own count from the pass's
per-position snapshots (`gdn.GdnSnapshots.restore_rows`); recurrent layers that are not
snapshotted are replayed (`replay.RowsReplay`). A chain of one-token steps (a draft model's
drafts) keeps every recurrent cache's state after each step (`StepStates`), and each row takes
its own. A cache list rolls back each of its caches. Other cache kinds are refused with a
one-line error (`BatchUnsupported`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.mlxlm import cut_window
from mtpkit.runtime.rollback.gdn import GdnSnapshots, is_recurrent_cache


class BatchUnsupported(MtpkitError):
    """A model (or a drafter) whose caches the batched decoder cannot roll back per row."""


def batch_caches(single: list[list[Any]]) -> list[Any]:
    """mlx-lm's batched caches (`merge`: KV caches left-padded to the longest row) of rows
    prefilled one at a time; `single[r]` is row r's cache list."""
    for cache in single[0]:
        require_batchable(cache)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*single, strict=True)]


def require_batchable(cache: Any, kinds: tuple[str, ...] | None = None) -> None:
    """Refuse a cache whose rows cannot be rolled back one by one (`kinds`: the names of the
    kinds allowed, default every kind this module rolls back)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    allowed = {KVCache, RotatingKVCache, ArraysCache}
    if kinds is not None:
        allowed = {k for k in allowed if k.__name__ in kinds}
    if type(cache) is CacheList:
        for part in cache.caches:
            require_batchable(part, kinds)
    elif type(cache) not in allowed:
        raise BatchUnsupported(
            f"batched decoding cannot roll back a {type(cache).__name__} per row: decode "
            "these requests one at a time"
        )


def leaves(caches: list[Any]) -> list[Any]:
    """The caches, a cache list's parts in its place."""
    from mlx_lm.models.cache import CacheList

    out = []
    for cache in caches:
        out += leaves(list(cache.caches)) if isinstance(cache, CacheList) else [cache]
    return out


def drop_per_row(cache: Any, drop: list[int]) -> None:
    """Drop the last `drop[r]` entries of row r of a `BatchKVCache` or a
    `BatchRotatingKVCache` (see the module's text)."""
    from mlx_lm.models.cache import BatchRotatingKVCache, CacheList

    if isinstance(cache, CacheList):
        for part in cache.caches:
            drop_per_row(part, drop)
        return
    common = min(drop)
    if common:
        cache.trim(common)
        if isinstance(cache, BatchRotatingKVCache):
            cut_window(cache)
    extra = [d - common for d in drop]
    if any(extra):
        roll_per_row(cache, mx.array(extra, dtype=mx.int32))


def roll_per_row(cache: Any, drop: mx.array) -> None:
    """Take the last `drop[r]` entries of row r (drop [B] int32, on the device: a round built
    before the verdict before it was read) out of a `BatchKVCache`'s visible window by rolling
    alone, the write index left where it is: the window's left padding grows by as much."""
    from mlx_lm.models.cache import CacheList, dynamic_roll

    if isinstance(cache, CacheList):
        for part in cache.caches:
            roll_per_row(part, drop)
        return
    # Rolling by drop[r] moves row r's rejected tail past the write index (or round into
    # the start of the buffer): either way outside [left_padding, write index).
    cache.keys = dynamic_roll(cache.keys, drop[:, None], axis=2)
    cache.values = dynamic_roll(cache.values, drop[:, None], axis=2)
    cache.offset = cache.offset - drop
    cache.left_padding = cache.left_padding + drop


@dataclass
class StepStates:
    """Every recurrent cache's state after each of a chain of one-token steps (`record`
    after each step, in order), so that each row takes its own (`restore_rows`)."""

    steps: list[list[list[Any]]] = field(default_factory=list)  # [step][cache][slot]

    def record(self, recurrent: list[Any]) -> None:
        self.steps.append([list(c.cache) for c in recurrent])

    def restore_rows(self, recurrent: list[Any], kept: mx.array) -> None:
        """Set row r of each cache to its state after step `kept[r] - 1` (kept [B] int32,
        each at least 1)."""
        rows = mx.arange(kept.shape[0])
        for i, cache in enumerate(recurrent):
            for slot in range(len(cache.cache)):
                values = [step[i][slot] for step in self.steps]
                if any(v is None for v in values):
                    continue
                cache.cache[slot] = mx.stack(values)[kept - 1, rows]


def rollback_rows(
    caches: list[Any],
    length: int,
    kept: list[int] | mx.array,
    states: GdnSnapshots | StepStates | None,
) -> None:
    """Keep row r's state after its first `kept[r]` of a pass's `length` inputs, by cache
    kind: KV caches (sliding windows too) drop each row's own tail (`kept` a host list) or
    roll it out of the window (`kept` on the device: KV caches only, no window cut), and
    recurrent caches take each row's state from `states` (the pass's per-position snapshots,
    or a chain's per-step states). Replayed caches are `replay.RowsReplay`'s."""
    on_device = isinstance(kept, mx.array)
    if not on_device and all(k == length for k in kept):
        return
    recurrent = []
    for cache in caches:
        if is_recurrent_cache(cache):
            recurrent.append(cache)
        elif on_device:
            roll_per_row(cache, length - kept)
        else:
            drop_per_row(cache, [length - k for k in kept])
    if recurrent:
        if states is None:
            raise BatchUnsupported("a recurrent cache was rolled back without its states")
        states.restore_rows(recurrent, kept if on_device else mx.array(kept, dtype=mx.int32))
