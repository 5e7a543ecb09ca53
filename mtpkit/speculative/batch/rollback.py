"""A batched verify pass and its rollback per row: each row keeps its own accepted prefix.

The rows of a batch share one verify pass over `[B, K+1]` tokens but keep different counts.
mlx-lm's batched caches hold the rows left-aligned on one write index (`BatchKVCache`: per-row
`offset` and `left_padding`, the mask hides each row's padding), so one `trim` cannot drop
different tails. Here every KV cache is trimmed by the fewest rejected tokens of any row, and
a row that rejected more is rolled right by the rest: its rejected entries leave the visible
window and its left padding grows by as much, as mlx-lm's own `BatchKVCache.finalize` turns a
right-padded prompt into a left-padded one. Its `offset` (the RoPE position) drops by the
same count, so its next tokens get the positions a single stream would give them.

Gated-delta-net layers keep a conv state and a recurrent state per row; the verify pass
records both after every position (`mtpkit.runtime.rollback.gdn`), and each row takes the
state after its own kept count. Other cache kinds (sliding windows, replayed recurrent
layers, cache lists) are refused with a one-line error: they are not batched yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import MtpModel
from mtpkit.runtime.rollback.gdn import GdnSnapshots, capture_gdn_states, is_recurrent_cache
from mtpkit.runtime.rollback.replay import gdn_covers


class BatchUnsupported(MtpkitError):
    """A model whose caches the batched decoder cannot roll back per row."""


def batch_caches(single: list[list[Any]]) -> list[Any]:
    """mlx-lm's batched caches (`merge`: KV caches left-padded to the longest row) of rows
    prefilled one at a time; `single[r]` is row r's cache list."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    for cache in single[0]:
        if type(cache) not in (KVCache, ArraysCache):
            raise BatchUnsupported(
                f"batched decoding rolls back KV caches and gated-delta-net states only, not a "
                f"{type(cache).__name__}: decode these requests one at a time"
            )
    return [type(layer[0]).merge(list(layer)) for layer in zip(*single, strict=True)]


def drop_per_row(cache: Any, drop: list[int]) -> None:
    """Drop the last `drop[r]` entries of row r of a `BatchKVCache` (see the module's text)."""
    from mlx_lm.models.cache import dynamic_roll

    common = min(drop)
    if common:
        cache.trim(common)
    extra = [d - common for d in drop]
    if not any(extra):
        return
    shift = mx.array(extra, dtype=mx.int32)
    # Rolling by shift[r] moves row r's rejected tail past the write index (or round into
    # the start of the buffer): either way outside [left_padding, write index).
    cache.keys = dynamic_roll(cache.keys, shift[:, None], axis=2)
    cache.values = dynamic_roll(cache.values, shift[:, None], axis=2)
    cache.offset = cache.offset - shift
    cache.left_padding = cache.left_padding + shift


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
class BatchVerifyPass:
    """One backbone pass over `[B, T]` tokens, with what rolling each row back needs."""

    logits: mx.array  # [B, T, V]
    hidden: mx.array  # [B, T, H]
    snapshots: GdnSnapshots | None
    length: int

    def rollback(self, caches: list[Any], kept: list[int]) -> None:
        """Keep row r's state after its first `kept[r]` verified tokens only."""
        drop = [self.length - k for k in kept]
        if not any(drop):
            return
        recurrent = []
        for cache in caches:
            if is_recurrent_cache(cache):
                recurrent.append(cache)
            else:
                drop_per_row(cache, drop)
        if recurrent:
            restore_per_row(self.snapshots, recurrent, mx.array(kept, dtype=mx.int32))


def verify_rows(m: MtpModel, tokens: mx.array, caches: list[Any]) -> BatchVerifyPass:
    """The backbone over `tokens` [B, T] with every gated-delta-net layer's per-position
    states kept, so that each row can roll back to its own prefix."""
    recurrent = any(is_recurrent_cache(c) for c in caches)
    if recurrent and not gdn_covers(m.model, caches, is_recurrent_cache):
        raise BatchUnsupported(
            f"{m.path.name} keeps recurrent states other than gated delta nets', which batched "
            "decoding cannot roll back per row yet: decode these requests one at a time"
        )
    snapshots = GdnSnapshots() if recurrent else None
    with capture_gdn_states(snapshots):
        logits, hidden = m.forward(tokens, caches)
    return BatchVerifyPass(logits, hidden, snapshots, tokens.shape[1])
