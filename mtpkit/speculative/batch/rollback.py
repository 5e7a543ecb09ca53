"""A batched verify pass and its rollback per row: each row keeps its own accepted prefix.

The rows of a batch share one verify pass over `[B, K+1]` tokens but keep different counts.
mlx-lm's batched caches hold the rows left-aligned on one write index (`BatchKVCache`: per-row
`offset` and `left_padding`, the mask hides each row's padding), so one `trim` cannot drop
different tails. Here every KV cache is trimmed by the fewest rejected tokens of any row, and
a row that rejected more is rolled right by the rest: its rejected entries leave the visible
window and its left padding grows by as much, as mlx-lm's own `BatchKVCache.finalize` turns a
right-padded prompt into a left-padded one. Its `offset` (the RoPE position) drops by the
same count, so its next tokens get the positions a single stream would give them.

A sliding window (`BatchRotatingKVCache`) is rolled back the same way: a pass of several
tokens leaves it in temporal order, so its common tail is cut off the buffer (mlx-lm's `trim`
only moves the write index, and a one-token step, a plain batched step, keeps the buffer's
last `window` entries, rejected ones included: as `mtpkit.runtime.rollback.window` cuts one
stream's), then rows are rolled. Before each verify pass a window that plain one-token steps
rotated is put back in temporal order (`mtpkit.mlxlm.window_in_temporal_order`); the pass
trims from each row's front the same real entries as the row's own stream would.

Gated-delta-net layers keep a conv state and a recurrent state per row; the verify pass
records both after every position (`mtpkit.runtime.rollback.gdn`), and each row takes the
state after its own kept count. Recurrent layers the verify pass does not snapshot (Mamba,
Kimi delta attention, lightning attention) are replayed, as for one stream
(`mtpkit.runtime.rollback.replay`), over each row's kept prefix, in one pass per distinct kept
count: within a pass a row is real throughout or not at all; mlx-lm's
`prepare(right_padding=...)`/`finalize` roll a row that is not right by the pass's length, and
its recurrent states are put back after the pass. A cache list rolls back each
of its caches. Other cache kinds are refused with a one-line error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.mlxlm import cut_window, window_in_temporal_order
from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.kernels.prompt import conv_by_ops
from mtpkit.runtime.kernels.routing import multi_row_matmuls
from mtpkit.runtime.model import MtpModel
from mtpkit.runtime.rollback.gdn import GdnSnapshots, capture_gdn_states, is_recurrent_cache
from mtpkit.runtime.rollback.replay import gdn_covers, is_trimmable
from mtpkit.runtime.rollback.state import restore_state, saved_state


class BatchUnsupported(MtpkitError):
    """A model whose caches the batched decoder cannot roll back per row."""


def batch_caches(single: list[list[Any]]) -> list[Any]:
    """mlx-lm's batched caches (`merge`: KV caches left-padded to the longest row) of rows
    prefilled one at a time; `single[r]` is row r's cache list."""
    for cache in single[0]:
        _require_batchable(cache)
    return [type(layer[0]).merge(list(layer)) for layer in zip(*single, strict=True)]


def _require_batchable(cache: Any) -> None:
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    if type(cache) is CacheList:
        for part in cache.caches:
            _require_batchable(part)
    elif type(cache) not in (KVCache, RotatingKVCache, ArraysCache):
        raise BatchUnsupported(
            f"batched decoding cannot roll back a {type(cache).__name__} per row: decode "
            "these requests one at a time"
        )


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


def restore_per_row(snapshots: GdnSnapshots, caches: list[Any], kept: mx.array) -> None:
    """Set each gated-delta-net cache's row r to its state after `kept[r]` verified tokens
    (kept [B] int32, each at least 1)."""
    rows = mx.arange(kept.shape[0])
    for cache, conv_input, states in zip(caches, snapshots.conv_inputs, snapshots.states,
                                         strict=True):  # fmt: skip
        n_keep = cache[0].shape[1]
        window = (kept[:, None] + mx.arange(n_keep)[None, :])[..., None]
        cache[0] = mx.take_along_axis(conv_input, window, axis=1)
        stacked = states if isinstance(states, mx.array) else mx.stack(states)
        cache[1] = stacked[kept - 1, rows]


@dataclass
class BatchReplay:
    """The caches' state before a verify pass over `tokens` [B, T] (None for a trimmable
    cache), and the forward that replays each row's kept prefix."""

    tokens: mx.array
    saved: list[Any]
    forward: Callable[[mx.array, list[Any]], Any]

    @classmethod
    def before(
        cls, caches: list[Any], tokens: mx.array, forward: Callable[..., Any]
    ) -> BatchReplay:
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

        n = end - start
        padding = [0 if r else n for r in real]
        recurrent = [c for c in _leaves(caches) if isinstance(c, ArraysCache)]
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


@dataclass
class BatchVerifyPass:
    """One backbone pass over `[B, T]` tokens, with what rolling each row back needs."""

    logits: mx.array  # [B, T, V]
    hidden: mx.array  # [B, T, H]
    snapshots: GdnSnapshots | None
    length: int
    replay: BatchReplay | None = None
    windows: bool = False  # some cache is a sliding window (`BatchRotatingKVCache`)

    def rollback(self, caches: list[Any], kept: list[int]) -> None:
        """Keep row r's state after its first `kept[r]` verified tokens only."""
        drop = [self.length - k for k in kept]
        if not any(drop):
            return
        if self.replay is not None:
            self.replay.rollback(caches, kept)
            return
        recurrent = []
        for cache in caches:
            if is_recurrent_cache(cache):
                recurrent.append(cache)
            else:
                drop_per_row(cache, drop)
        if recurrent:
            restore_per_row(self.snapshots, recurrent, mx.array(kept, dtype=mx.int32))

    @property
    def rolls_on_device(self) -> bool:
        """Whether `rollback_on_device` can roll this pass back: no cache is replayed and no
        sliding window needs its tail cut (which the host does with counts it has read)."""
        return self.replay is None and not self.windows

    def rollback_on_device(self, caches: list[Any], kept: mx.array) -> None:
        """`rollback` with the kept counts on the device ([B] int32, not read yet): each KV
        cache is rolled, never trimmed (a round's rejected entries stay as left padding),
        and each gated-delta-net row takes its state after its own count."""
        recurrent = []
        for cache in caches:
            if is_recurrent_cache(cache):
                recurrent.append(cache)
            else:
                roll_per_row(cache, self.length - kept)
        if recurrent:
            restore_per_row(self.snapshots, recurrent, kept)


def _leaves(caches: list[Any]) -> list[Any]:
    """The caches, a cache list's parts in its place."""
    from mlx_lm.models.cache import CacheList

    out = []
    for cache in caches:
        out += _leaves(list(cache.caches)) if isinstance(cache, CacheList) else [cache]
    return out


def verify_rows(m: MtpModel, tokens: mx.array, caches: list[Any]) -> BatchVerifyPass:
    """The backbone over `tokens` [B, T] with every gated-delta-net layer's per-position
    states kept, so that each row can roll back to its own prefix."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    recurrent = any(is_recurrent_cache(c) for c in caches)
    replay = None
    if recurrent and not gdn_covers(m.model, caches, is_recurrent_cache):
        replay = BatchReplay.before(caches, tokens, lambda t, c: m.model(t, cache=c))
        recurrent = False
    snapshots = GdnSnapshots() if recurrent else None
    windows = False
    for cache in _leaves(caches):
        if isinstance(cache, BatchRotatingKVCache):
            window_in_temporal_order(cache)
            windows = True
    rows = tokens.shape[0] * tokens.shape[1]
    with (  # as one stream's verify: the rows' matmuls routed as measured, few-query attention
        capture_gdn_states(snapshots),
        multi_row_matmuls(m.model, rows),
        few_query_attention(),
        conv_by_ops(),  # CUDA: no conv build at each new width and depth
    ):
        logits, hidden = m.forward(tokens, caches)
    return BatchVerifyPass(logits, hidden, snapshots, tokens.shape[1], replay, windows)
