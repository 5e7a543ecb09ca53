"""Which quantized matmuls of a verify pass take the multi-row kernel (`qmv`), measured where
the model runs, and the switch that routes them.

MLX's CUDA quantized matmul costs about one weight stream per row at a few rows; `qmv`
streams the weights once for all rows but has a fixed cost of its own. Which one is faster
depends on the matrix and the rows: on an H100 the kernel took 86-92 us on the 248,320 x
1024 lm_head at 2..5 rows against MLX's 309-746, and 27 us on a 16 x 1024 matrix against
MLX's 12. A rule from one machine's table fits another machine's badly, so (CUDA only,
`route_quantized_layers` at load) each distinct matrix of the model is timed both ways at
the rows a verify pass gives it, laid out as the pass lays them out (one stream's [1, K+1],
a batch's [B, K+1]: MLX's cost depends on the layout too), the first time it does (medians
of interleaved batches on its own weights), and takes the kernel where it was at least
`MARGIN` faster (at 2 rows, only on matrices of `WIDE_WEIGHTS` or more: see
`TIMED_FROM_ROWS`). A route is kept per matrix and row count: the first layout met decides
(a process decodes one stream's rounds or a batch's, not both). On an H200 (2026-11-27),
qwen3_5-9b with 4 requests in a batch at depth 1 decoded at 1.57x stock's batched decoding
with its verify routed, 1.10x without (docs/PERFORMANCE.md).
`MTPKIT_QMV=1` routes every matrix the kernel can take, `0` none.

Only the layers that may take the kernel are tapped, and only during a verify pass:
`multi_row_matmuls(model)` swaps their class in and back out, so a plain step (mtpkit's, or
stock mlx-lm's on the same model) makes no extra Python call per layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import statistics
import time
import weakref
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.runtime.kernels import qmv

MARGIN = 0.9  # the kernel must take at most this share of MLX's time to be chosen
# At 2 rows only very wide matrices (the lm_head) are timed; the others stay with MLX's. On an
# H100 (qwen3_5-4b, 2026-11-25) the timings routed every matrix from 2560 x 2560 up at 2 rows
# too, and the 2-token verify forward then cost 1.34 of a 1-token one, against 1.19 with
# MLX's matmul everywhere (issue 18's table); at 3-4 tokens it cost 1.44-1.45 (flat), where
# MLX's grows with the rows (qwen3_5-9b: a 4-token verify took 1.79 times a 2-token one
# with the lm_head alone routed). Again on an H100 (qwen3_5-9b, 2026-11-26, `bash
# bench/gpu_bench.sh bench ab-rows2`, 5 interleaved trials): the timings routed every matrix
# from 4096 x 4096 up at 2 rows, and depth 1 then ran at 1.05x stock at acceptance 0.8 and
# 1.08x at 0.9, against 1.14x and 1.17x with only the lm_head routed at 2 rows.
TIMED_FROM_ROWS = 3
WIDE_WEIGHTS = 64 * 1024 * 1024
BATCHES = 5  # interleaved timing batches per matrix and rows (median taken)
LAUNCHES = 8  # products per batch

# (out features, in features, rows, group size, dtype name) -> whether the kernel takes it,
# decided once per process on first use: timed (MEASURED) or taken (ALL, MTPKIT_QMV=1).
Key = tuple[int, int, int, int, str]
ROUTES: dict[Key, bool] = {}
MEASURED, ALL = "measured", "all"
_POLICY = [MEASURED]

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("mtpkit_qmv", default=False)
Layer = tuple[nn.Module, type]  # a quantized layer and the class that routes it
# id(model) -> (a weak reference to it, its tapped layers, per row count once a pass of
# that many rows has run, the layers routed to the kernel: what such a pass swaps in).
_TAPPED: dict[int, tuple[weakref.ref, list[Layer], dict[int, list[Layer]]]] = {}


def route_key(module: nn.Module, rows: int) -> Key:
    """A route's key: the matrix, and the rows the kernel is built for (`qmv.built_rows`:
    a batch's row counts past MAX_ROWS share the route of their tile of 8)."""
    w = module["weight"]
    return (w.shape[0], w.shape[1] * 32 // module.bits, qmv.built_rows(rows), module.group_size,
            str(module["scales"].dtype))  # fmt: skip


def takes_kernel(module: nn.Module, x: mx.array) -> bool:
    """Whether `x`'s rows times `module`'s matrix go to the kernel (inside a verify pass). A
    (matrix, rows) seen for the first time is timed now (`MEASURED`) or taken (`ALL`)."""
    rows = qmv.rows_of(x.shape)
    if not qmv.MIN_ROWS <= rows <= qmv.MAX_ROWS and not (
        qmv.MIN_ROWS <= rows <= qmv.MMA_MAX_ROWS and _tensor_cores(module, x)
    ):
        return False
    key = route_key(module, rows)
    if key not in ROUTES:
        ROUTES[key] = _POLICY[0] == ALL or _kernel_wins(module, x.shape[:-1])
    return ROUTES[key]


def _layers_for(model: nn.Module, rows: int | None) -> tuple[list[Layer], bool]:
    """The tapped layers of `model` a pass of `rows` rows swaps in, and whether that list is
    to be settled after the pass: all of them until a pass of `rows` has decided the routes
    of the layers it used, then only those routed to the kernel (a layer left to MLX's
    matmul, or never used with that many rows, costs no Python call per pass)."""
    entry = _TAPPED.get(id(model))
    if entry is None or entry[0]() is not model:
        return [], False
    _, layers, settled = entry
    if rows is None:
        return layers, False
    if rows in settled:
        return settled[rows], False
    return layers, True


def _settle(model: nn.Module, rows: int) -> None:
    _, layers, settled = _TAPPED[id(model)]
    routed = [layer for layer in layers if ROUTES.get(route_key(layer[0], rows), False)]
    settled[rows] = routed


@contextlib.contextmanager
def multi_row_matmuls(model: nn.Module, rows: int | None = None) -> Iterator[None]:
    """Within the block, `model`'s tapped layers send the rows their routes name to the
    kernel (`rows`: the pass's row count, when known)."""
    layers, settle = _layers_for(model, rows)
    before = [type(module) for module, _ in layers]
    for module, tapped in layers:
        module.__class__ = tapped
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        for (module, _), cls in zip(layers, before, strict=True):
            module.__class__ = cls
    if settle:  # a pass that completed: every layer it used has its route for `rows`
        _settle(model, rows)


def _routed(module: nn.Module, x: mx.array) -> mx.array | None:
    """The kernel's product of `x` with `module`'s weight, or None where it does not apply."""
    if not _ACTIVE.get() or not takes_kernel(module, x):
        return None
    return kernel_product(module, x)


def _tensor_cores(module: nn.Module, x: mx.array) -> bool:
    """Whether the kernel's tensor-core variant takes `x` times `module`'s matrix."""
    w, scales, biases = module["weight"], module["scales"], module["biases"]
    return qmv.mma_shape_ok(rows=qmv.rows_of(x.shape), n=w.shape[0], k=x.shape[-1],
                            group_size=module.group_size,
                            dtypes=(x.dtype, scales.dtype, biases.dtype))  # fmt: skip


def kernel_product(module: nn.Module, x: mx.array) -> mx.array:
    """`x` times `module`'s matrix by the kernel: its tensor-core variant where it applies."""
    w, scales, biases = module["weight"], module["scales"], module["biases"]
    return qmv.multi_row_qmv(x, w, scales, biases, group_size=module.group_size,
                             variant="mma" if _tensor_cores(module, x) else "fma")  # fmt: skip


class RowsQuantizedLinear(nn.QuantizedLinear):
    """A `QuantizedLinear` that takes the multi-row kernel inside a verify pass."""

    def __call__(self, x: mx.array) -> mx.array:
        y = _routed(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    """A `QuantizedEmbedding` whose tied output projection takes the kernel likewise."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = _routed(self, x)
        return super().as_linear(x) if y is None else y


_TAPS = {nn.QuantizedLinear: RowsQuantizedLinear, nn.QuantizedEmbedding: RowsQuantizedEmbedding}


def kernel_can_take(module: nn.Module) -> bool:
    """A quantized layer whose matrix the kernel handles (affine 4-bit with biases, ...)."""
    if type(module) not in _TAPS:
        return False
    n, k = route_key(module, 1)[:2]
    return qmv.kernel_shape_ok(
        bits=module.bits, group_size=module.group_size, mode=getattr(module, "mode", "affine"),
        n=n, k=k, biased=module.get("biases") is not None,
    )  # fmt: skip


def route_quantized_layers(model: nn.Module, *, measure: bool = True) -> int:
    """Tap `model`'s quantized layers that the kernel can take for `multi_row_matmuls(model)`;
    each (matrix, rows) is routed on its first verify pass, by timing (`measure`) or to the
    kernel. Returns how many layers are tapped. Timing at load instead would build the
    kernel for every matrix and row count, most never used (~1 s each on an H100)."""
    _POLICY[0] = MEASURED if measure else ALL
    layers = [
        (module, _TAPS[type(module)])
        for _, module in model.named_modules()
        if kernel_can_take(module)
    ]
    _TAPPED[id(model)] = (weakref.ref(model), layers, {})
    weakref.finalize(model, _TAPPED.pop, id(model), None)
    return len(layers)


def _kernel_wins(module: nn.Module, lead: tuple[int, ...]) -> bool:
    if qmv.rows_of((*lead, 1)) < TIMED_FROM_ROWS and weights_of(module) < WIDE_WEIGHTS:
        return False
    try:
        mlx_s, kernel_s = time_both(module, lead)
    except Exception:  # a shape the kernel fails to build for stays with MLX's matmul
        return False
    return kernel_s <= MARGIN * mlx_s


def weights_of(module: nn.Module) -> int:
    """Out features * in features of a quantized layer."""
    n, k = route_key(module, 1)[:2]
    return n * k


def time_both(module: nn.Module, lead: tuple[int, ...]) -> tuple[float, float]:
    """Median seconds of a batch of `LAUNCHES` products of random rows [*lead, K] (as the
    pass gives them: a batch's verify [B, K+1], one stream's [1, K+1]) with `module`'s
    matrix: MLX's quantized matmul and the kernel, batches interleaved. MLX's cost depends on
    how the rows are laid out, not only on how many there are."""
    w, scales, biases = module["weight"], module["scales"], module["biases"]
    gs, k = module.group_size, route_key(module, 1)[1]
    rows = qmv.rows_of((*lead, 1))
    x = mx.random.normal((*lead, k), key=mx.random.key(rows)).astype(scales.dtype)

    def theirs() -> mx.array:
        return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=gs, bits=4)

    def ours() -> mx.array:
        return kernel_product(module, x)

    times: list[list[float]] = [[], []]
    for batch in range(BATCHES + 1):  # the first: warm-up (the kernel's build)
        for i, fn in enumerate((theirs, ours)):
            t0 = time.perf_counter()
            mx.eval([fn() for _ in range(LAUNCHES)])
            if batch:
                times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def routes_summary() -> dict[str, Any]:
    """The measured routes, for reports: 'NxK@rows' -> True (kernel) / False (MLX)."""
    return {f"{n}x{k}@{rows}": v for (n, k, rows, _, _), v in sorted(ROUTES.items())}
