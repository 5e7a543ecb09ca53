"""One verify pass over the rows of a batch and how it is undone, each row to its own
accepted prefix: `verify_pass`'s one-row pass for `[B, T]` tokens.

Every cache kind goes through `rows.rollback_rows` (KV caches and sliding windows per row,
gated-delta-net states from the pass's own per-position snapshots), and caches the snapshots
do not cover (Mamba, Kimi delta attention, lightning attention) are replayed over each row's
kept prefix, as for one stream (`replay.RowsReplay`). Before the pass a sliding window that
one-token steps rotated is put back in temporal order (`mtpkit.mlxlm.window_in_temporal_order`);
the pass trims from each row's front the same real entries as the row's own stream would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.mlxlm import window_in_temporal_order
from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.kernels.prompt import conv_by_ops
from mtpkit.runtime.kernels.routing import multi_row_matmuls
from mtpkit.runtime.model import MtpModel
from mtpkit.runtime.rollback.gdn import GdnSnapshots, capture_gdn_states, is_recurrent_cache
from mtpkit.runtime.rollback.replay import RowsReplay, gdn_covers
from mtpkit.runtime.rollback.rows import leaves, rollback_rows


@dataclass
class BatchVerifyPass:
    """One backbone pass over `[B, T]` tokens, with what rolling each row back needs."""

    logits: mx.array  # [B, T, V]
    hidden: mx.array  # [B, T, H]
    snapshots: GdnSnapshots | None
    length: int
    replay: RowsReplay | None = None
    windows: bool = False  # some cache is a sliding window (`BatchRotatingKVCache`)

    def rollback(self, caches: list[Any], kept: list[int]) -> None:
        """Keep row r's state after its first `kept[r]` verified tokens only."""
        if all(k == self.length for k in kept):
            return
        if self.replay is not None:
            self.replay.rollback(caches, kept)
            return
        rollback_rows(caches, self.length, kept, self.snapshots)

    @property
    def rolls_on_device(self) -> bool:
        """Whether `rollback_on_device` can roll this pass back: no cache is replayed and no
        sliding window needs its tail cut (which the host does with counts it has read)."""
        return self.replay is None and not self.windows

    def rollback_on_device(self, caches: list[Any], kept: mx.array) -> None:
        """`rollback` with the kept counts on the device ([B] int32, not read yet): each KV
        cache is rolled, never trimmed (a round's rejected entries stay as left padding),
        and each gated-delta-net row takes its state after its own count."""
        rollback_rows(caches, self.length, kept, self.snapshots)


def verify_rows(m: MtpModel, tokens: mx.array, caches: list[Any]) -> BatchVerifyPass:
    """The backbone over `tokens` [B, T] with every gated-delta-net layer's per-position
    states kept, so that each row can roll back to its own prefix."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    recurrent = any(is_recurrent_cache(c) for c in caches)
    replay = None
    if recurrent and not gdn_covers(m.model, caches, is_recurrent_cache):
        replay = RowsReplay.before(caches, tokens, lambda t, c: m.model(t, cache=c))
        recurrent = False
    snapshots = GdnSnapshots() if recurrent else None
    windows = False
    for cache in leaves(caches):
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
