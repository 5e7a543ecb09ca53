"""Attention of a few queries over a key length that grows every round, without a per-length
build (MLX's CUDA backend).

A drafting round attends 2-5 queries (the verify pass, the head's step over the verified
pairs) over a key length it has never seen. On MLX's CUDA build,
`mx.fast.scaled_dot_product_attention` with more than one query and a head size its cuDNN
path takes (32, 64, 128: every full-attention model but Qwen3.5/3.6's and Qwen3-Next's 256)
builds a cuDNN graph for each new key length: ~40 ms with a causal mask, ~300 ms with an
array mask, on an H100/H200, against ~0.1 ms once built (`bench/sdpa_shapes.py`), so every
round paid a build, about 40 stock steps of the bundled example. One query (stock decoding)
and head size 256 take kernels that need no build.

Inside `few_query_attention()` (on CUDA only, unless forced), a call with 2 to
`MAX_QUERIES` queries is computed from MLX's plain ops, as MLX's own fallback computes it
(scores in the inputs' dtype, a precise softmax, grouped-query heads broadcast): a handful
of graph nodes a layer, no build. Other calls, and calls with attention sinks, go to MLX's.
`MTPKIT_KERNELS=0` leaves MLX's everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mtpkit.core.environment import switch
from mtpkit.runtime.kernels.gdn_verify import cuda_available

MAX_QUERIES = 16  # longer calls (prefill chunks, the head's catch-up) build once per shape


def attention_by_ops(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None
) -> mx.array:
    """Scaled dot-product attention from plain ops. q [B, Hq, L, D], k [B, Hk, S, D],
    v [B, Hk, S, Dv], Hq a multiple of Hk; `mask`: None, "causal" (query i sees keys up to
    S - L + i), a boolean array (True: attend) or an additive one, broadcastable to
    [B, Hq, L, S]."""
    b, hq, length, d = q.shape
    hk, keys = k.shape[1], k.shape[2]
    rep = hq // hk
    q = (q * scale).reshape(b, hk, rep, length, d)
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, Hk, rep, L, S]
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        rows = mx.arange(keys - length, keys)[:, None]
        mask = rows >= mx.arange(keys)[None]
    if mask is not None:
        mask = _grouped(mask, hk, rep)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-float("inf"), scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights @ mx.expand_dims(v, 2)  # [B, Hk, rep, L, Dv]
    return out.reshape(b, hq, length, v.shape[-1])


def _grouped(mask: mx.array, hk: int, rep: int) -> mx.array:
    """A mask over [.., Hq, L, S] (or [L, S]) laid out over [.., Hk, rep, L, S]."""
    if mask.ndim < 3 or mask.shape[-3] == 1:
        return mx.expand_dims(mask, -3)  # the same for every head
    return mask.reshape(*mask.shape[:-3], hk, rep, *mask.shape[-2:])


@contextlib.contextmanager
def few_query_attention(force: bool = False) -> Iterator[None]:
    """Within the block, attention of 2..MAX_QUERIES queries is computed by
    `attention_by_ops` (on CUDA, or anywhere with `force`)."""
    if not (force or (cuda_available() and switch("MTPKIT_KERNELS") is not False)):
        yield
        return
    fast = mx.fast
    original = fast.scaled_dot_product_attention

    def sdpa(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None,
             **kwargs: Any) -> mx.array:  # fmt: skip
        if kwargs.get("sinks") is not None or not 2 <= q.shape[2] <= MAX_QUERIES:
            return original(q, k, v, scale=scale, mask=mask, **kwargs)
        return attention_by_ops(q, k, v, scale=scale, mask=mask)

    fast.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        fast.scaled_dot_product_attention = original
