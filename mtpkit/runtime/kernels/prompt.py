"""A prompt's chunk on MLX's CUDA build without a build for every new length.

A prefill chunk (and the head's catch-up over a prompt) has a length no earlier call had, and
two of its ops are built per shape on MLX's CUDA build: the gated-delta-net's depthwise
conv1d (a cuDNN convolution: ~140 ms for every new length on an H200) and attention of more
than one query at head sizes up to 128 (a cuDNN graph: ~40 ms with a causal mask; head size
256 takes a kernel with no build). Once built, each costs ~0.1 ms: a server meeting prompts
of many lengths paid ~0.3 s of builds a request on the bundled example, stalling every row
of the batch at each join (docs/PERFORMANCE.md, 2026-12-02).

A batched verify pass meets the same conv build at every new batch width and depth (its conv
input is [rows, depth + 4, channels]); `conv_by_ops()` routes only the conv, for those. One
stream's verify keeps MLX's conv: it meets a few (1, depth) shapes, each built once, and the
shifted products cost more host time than the builds save (qwen3_5-0.8b at depth 1 on an
H200: 1.15x stock with them, 1.35x without; docs/PERFORMANCE.md, 2026-12-02).

Inside `prompt_chunk()` (on CUDA only, unless forced), the depthwise conv1d is computed as
the sum of its K shifted products (float32, as a convolution accumulates) and attention of
more than `MAX_QUERIES` queries at head sizes up to 128 from plain ops
(`attention.attention_by_ops`, MLX's own fallback), while its score matrix stays within
`SCORE_BUDGET` elements (longer chunks keep MLX's, and its build). `MTPKIT_KERNELS=0`
leaves MLX's everywhere; `MTPKIT_CONV_OPS=0` leaves MLX's conv in batched verify passes
(the shifted products are ~11 ops a layer where the conv is one: host time on a backend bound
by graph building, against a build at each new shape).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mtpkit.core.environment import switch
from mtpkit.runtime.kernels.attention import MAX_QUERIES, attention_by_ops
from mtpkit.runtime.kernels.gdn_verify import cuda_available

# Attention of a prompt chunk from ops while B * heads * queries * keys stays under this
# (bfloat16 scores of 256 MiB at most, freed after each layer).
SCORE_BUDGET = 1 << 27
# Head sizes whose multi-query attention MLX's CUDA build sends to cuDNN (a build a shape).
CUDNN_HEAD_SIZES = range(1, 129)


def depthwise_conv1d_by_ops(x: mx.array, weight: mx.array) -> mx.array:
    """mlx's `conv1d(x, weight, groups=C)` with stride 1, no padding and no dilation, as a
    sum of shifted products: x [B, L, C], weight [C, K, 1] -> [B, L - K + 1, C]."""
    k = weight.shape[1]
    steps = x.shape[1] - k + 1
    xf, wf = x.astype(mx.float32), weight[:, :, 0].astype(mx.float32)
    out = xf[:, 0:steps, :] * wf[:, 0]
    for j in range(1, k):
        out = out + xf[:, j : j + steps, :] * wf[:, j]
    return out.astype(x.dtype)


def _is_depthwise(x: mx.array, weight: mx.array, stride, padding, dilation, groups) -> bool:
    return (
        weight.ndim == 3 and weight.shape[2] == 1 and groups == x.shape[-1] == weight.shape[0]
        and stride == 1 and padding == 0 and dilation == 1
    )  # fmt: skip


def _routed(force: bool) -> bool:
    return force or (cuda_available() and switch("MTPKIT_KERNELS") is not False)


@contextlib.contextmanager
def conv_by_ops(force: bool = False) -> Iterator[None]:
    """Within the block, a depthwise conv1d is computed from plain ops (on CUDA, or anywhere
    with `force`): a batched verify pass meets a new (rows, length) at every width and depth,
    each a cuDNN build of ~140 ms on first use (`MTPKIT_CONV_OPS=0`: MLX's conv)."""
    if not force and switch("MTPKIT_CONV_OPS") is False:
        yield
        return
    with _conv_routed(force):
        yield


@contextlib.contextmanager
def _conv_routed(force: bool) -> Iterator[None]:
    if not _routed(force):
        yield
        return
    conv1d = mx.conv1d

    def routed_conv1d(x, weight, stride=1, padding=0, dilation=1, groups=1, **kwargs):
        if kwargs or not _is_depthwise(x, weight, stride, padding, dilation, groups):
            return conv1d(x, weight, stride, padding, dilation, groups, **kwargs)
        return depthwise_conv1d_by_ops(x, weight)

    mx.conv1d = routed_conv1d
    try:
        yield
    finally:
        mx.conv1d = conv1d


@contextlib.contextmanager
def prompt_chunk(force: bool = False) -> Iterator[None]:
    """Within the block, a depthwise conv1d and long attention at small head sizes are
    computed from plain ops (on CUDA, or anywhere with `force`): no build per length."""
    if not _routed(force):
        yield
        return
    sdpa = mx.fast.scaled_dot_product_attention

    def routed_sdpa(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None,
                    **kwargs: Any) -> mx.array:  # fmt: skip
        scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        if (
            kwargs.get("sinks") is not None or q.shape[2] <= MAX_QUERIES
            or q.shape[-1] not in CUDNN_HEAD_SIZES or scores > SCORE_BUDGET
        ):  # fmt: skip
            return sdpa(q, k, v, scale=scale, mask=mask, **kwargs)
        return attention_by_ops(q, k, v, scale=scale, mask=mask)

    mx.fast.scaled_dot_product_attention = routed_sdpa
    try:
        with _conv_routed(force):
            yield
    finally:
        mx.fast.scaled_dot_product_attention = sdpa
