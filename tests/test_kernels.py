"""The verify pass's kernels, on a CPU machine: the per-position reference against a float32
numpy recurrence, the seam that swaps the implementation, the multi-row matmul's math and
routing (its arithmetic emulated in numpy against `mx.quantized_matmul`), and the kernel
sources (compiled with nvcc where the CUDA toolkit is installed). The kernels themselves run
on a CUDA GPU in bench/gpu_kernels.py."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gated_delta import gated_delta_update

from mtpkit.runtime.kernels import gdn_verify as kernels
from mtpkit.runtime.kernels import qmv, routing
from mtpkit.runtime.model import load_model
from mtpkit.runtime.rollback import gdn
from tests import cuda_emulator, cuda_source

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


# ---------------------------------------------------------------------------------------
# The gated delta rule, per position.


def numpy_gated_delta(q, k, v, a, b, A_log, dt_bias, state, mask=None):  # noqa: N803
    """The recurrence as docs/MTP_FORMATS.md writes it, float32 numpy, one token at a time:
    g = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b), S <- g S;
    S <- S + beta (v - S k) k^T; y = S q. Returns y and the state after every token."""
    f = np.float32
    q, k, v, a, b = (np.asarray(t, dtype=f) for t in (q, k, v, a, b))
    state = np.asarray(state, dtype=f).copy()
    g = np.exp(-np.exp(np.asarray(A_log, f)) * np.log1p(np.exp(a + np.asarray(dt_bias, f))))
    beta = 1 / (1 + np.exp(-b))
    rep = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, rep, axis=2), np.repeat(k, rep, axis=2)
    ys, states = [], []
    for t in range(q.shape[1]):
        if mask is None or mask[0, t]:
            state = state * (g[:, t, :, None, :] if g.ndim == 4 else g[:, t, :, None, None])
            kv_mem = np.einsum("bhvk,bhk->bhv", state, k[:, t])
            delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
            state = state + np.einsum("bhv,bhk->bhvk", delta, k[:, t])
            ys.append(np.einsum("bhvk,bhk->bhv", state, q[:, t]))
        else:
            ys.append(np.zeros_like(v[:, t]))
        states.append(state.copy())
    return np.stack(ys, axis=1), states


def gdn_inputs(T: int, hk: int = 2, hv: int = 4, dk: int = 64, dv: int = 32, seed: int = 0,  # noqa: N803
               per_channel: bool = False, rows: int = 1):  # fmt: skip
    """Random inputs of a gated-delta-net update (decay per key channel if `per_channel`)
    for `rows` sequences."""
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    gate = (hv, dk) if per_channel else (hv,)
    q = mx.random.normal((rows, T, hk, dk), key=ks[0]) * dk**-0.5
    k = mx.random.normal((rows, T, hk, dk), key=ks[1]) * dk**-0.5
    v = mx.random.normal((rows, T, hv, dv), key=ks[2])
    a = mx.random.normal((rows, T, *gate), key=ks[3])
    b = mx.random.normal((rows, T, hv), key=ks[4])
    A_log = mx.random.normal(gate, key=ks[5]) * 0.5  # noqa: N806
    dt_bias = mx.random.normal(gate, key=ks[6]) * 0.5
    state = mx.random.normal((rows, hv, dv, dk), key=ks[7]) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize(("T", "hk", "hv"), [(1, 2, 2), (3, 2, 2), (4, 2, 4), (5, 1, 4)])
def test_stepwise_verify_matches_the_float32_recurrence(T: int, hk: int, hv: int) -> None:  # noqa: N803
    """The reference verify (mlx-lm's update, one token at a time) gives every position's
    output and state of an independent float32 numpy loop, grouped heads included."""
    inputs = gdn_inputs(T, hk, hv)
    y, states = gdn.stepwise_verify(gated_delta_update, *inputs, None)
    ref_y, ref_states = numpy_gated_delta(*(np.array(t) for t in inputs))
    assert len(states) == T
    np.testing.assert_allclose(np.array(y), ref_y, atol=2e-5, rtol=1e-4)
    for t in range(T):
        np.testing.assert_allclose(np.array(states[t]), ref_states[t], atol=2e-5, rtol=1e-4)


def test_stepwise_verify_keeps_the_state_on_masked_positions() -> None:
    inputs = gdn_inputs(4)
    mask = mx.array([[True, False, True, True]])
    y, states = gdn.stepwise_verify(gated_delta_update, *inputs, mask)
    ref_y, ref_states = numpy_gated_delta(*(np.array(t) for t in inputs), np.array(mask))
    # A masked (padding) position's output is unused: mlx-lm's ops path computes it, its
    # Metal kernel (and ours) write zero. Only the state must stay.
    on = np.array(mask)[0]
    np.testing.assert_allclose(np.array(y)[:, on], ref_y[:, on], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(states[1]), ref_states[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(states[3]), ref_states[3], atol=2e-5, rtol=1e-4)


def test_the_kernels_gates_are_the_recurrences() -> None:
    """The g and beta the kernels are fed: mlx-lm's formulas, checked against numpy's."""
    _, _, _, a, b, A_log, dt_bias, _ = gdn_inputs(3)  # noqa: N806
    g, beta = kernels.gates(a, b, A_log, dt_bias)
    a_, b_, A_, dt_ = (np.array(t) for t in (a, b, A_log, dt_bias))  # noqa: N806
    np.testing.assert_allclose(np.array(g), np.exp(-np.exp(A_) * np.log1p(np.exp(a_ + dt_))),
                               rtol=1e-5)  # fmt: skip
    np.testing.assert_allclose(np.array(beta), 1 / (1 + np.exp(-b_)), rtol=1e-5)
    _, doubled = kernels.gates(a, b, A_log, dt_bias, allow_neg_eigval=True)
    np.testing.assert_allclose(np.array(doubled), 2 * np.array(beta), rtol=1e-6)


def test_kernel_supports_only_what_it_was_written_for() -> None:
    q, _, v, *_ = gdn_inputs(2, hk=2, hv=4, dk=64)
    assert kernels.kernel_supports(q, v, {"use_kernel": True})
    assert not kernels.kernel_supports(q, v, {"something_new": 1})
    q48 = mx.zeros((1, 2, 2, 48))
    assert not kernels.kernel_supports(q48, v, {})
    assert not kernels.kernel_supports(q, mx.zeros((1, 2, 3, 32)), {})


def test_a_verify_pass_runs_the_installed_implementation_and_keeps_its_states() -> None:
    """The seam: a verify pass over T tokens calls the installed implementation once per
    gated-delta-net layer with all T tokens, and rolls back with the states it returned."""
    m = load_model(EXAMPLE, with_head=False)
    calls: list[int] = []

    def recording(original, q, *rest, **kwargs):
        calls.append(q.shape[1])
        return gdn.stepwise_verify(original, q, *rest, **kwargs)

    cache = m.make_cache()
    m.forward(mx.array([[1, 2, 3, 4]]), cache)
    previous = gdn.set_gdn_verify_impl(recording)
    try:
        verified = m.verify(mx.array([5, 6, 7]), cache)
    finally:
        gdn.set_gdn_verify_impl(previous)
    layers = sum(1 for c in cache if gdn.is_recurrent_cache(c))
    assert calls == [3] * layers and layers > 0
    assert all(len(s) == 3 for s in verified.snapshots.states)
    verified.rollback(cache, 1)
    again, _ = m.forward(mx.array([[6]]), cache)
    fresh = m.make_cache()
    expected, _ = m.forward(mx.array([[1, 2, 3, 4, 5, 6]]), fresh)
    assert mx.allclose(again[0, -1], expected[0, -1], atol=1e-3, rtol=1e-3)


def test_nothing_is_installed_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this CPU machine the reference stays, whatever the model; so it does where
    `MTPKIT_KERNELS=0` says so."""
    m = load_model(EXAMPLE, with_head=False)
    assert kernels.use_fast_verify(m.model) == []
    assert gdn.set_gdn_verify_impl(gdn.stepwise_verify) is gdn.stepwise_verify
    monkeypatch.setenv("MTPKIT_KERNELS", "0")
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    assert kernels.use_fast_verify(m.model) == []


def test_the_kernel_is_installed_only_if_it_passes_its_self_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CUDA device the kernel is checked against the reference first: one that fails
    to build (as here, with no CUDA back-end) or to agree leaves the reference, with a
    warning on stderr; one that agrees is installed."""
    m = load_model(EXAMPLE, with_head=False)
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    assert kernels.use_fast_verify(m.model) == []
    assert "using the reference" in capsys.readouterr().err
    assert gdn.set_gdn_verify_impl(gdn.stepwise_verify) is gdn.stepwise_verify

    def off_by_a_bit(original, *args, **kwargs):
        y, states = gdn.stepwise_verify(original, *args, **kwargs)
        return y + 1e-3, states

    assert kernels.self_check(off_by_a_bit, mlx_lms_own) == pytest.approx(1e-3, rel=1e-2)
    monkeypatch.setattr(kernels, "gdn_verify_cuda", off_by_a_bit)
    monkeypatch.setattr(kernels, "gdn_plain_cuda", mlx_lms_own)
    assert kernels.use_fast_verify(m.model) == []
    assert "differs from the reference by 1.0e-03" in capsys.readouterr().err
    monkeypatch.setattr(kernels, "gdn_verify_cuda", gdn.stepwise_verify)
    monkeypatch.setattr(kernels, "gdn_plain_cuda", mlx_lms_own)
    try:
        assert kernels.use_fast_verify(m.model) == ["gdn_verify", "gdn_plain"]
    finally:
        gdn.set_gdn_verify_impl(gdn.stepwise_verify)
        gdn.set_gdn_plain_impl(None)
    monkeypatch.setenv("MTPKIT_GDN_PLAIN", "0")  # the verify kernel only
    try:
        assert kernels.use_fast_verify(m.model) == ["gdn_verify"]
    finally:
        gdn.set_gdn_verify_impl(gdn.stepwise_verify)
    assert gdn.set_gdn_plain_impl(None) is None


def mlx_lms_own(original, *args, **kwargs):
    """A stand-in for a call outside a verify pass: mlx-lm's own update."""
    return original(*args, **kwargs)


def test_the_metal_twin_is_installed_behind_the_same_self_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On an Apple GPU the Metal twin is checked first; here (no Metal back-end) it fails to
    build, which leaves the reference with one warning line naming Metal; one that agrees
    is installed (and no CUDA-only matmul is tapped)."""
    m = load_model(EXAMPLE, with_head=False)
    monkeypatch.setattr(kernels, "cuda_available", lambda: False)
    monkeypatch.setattr(kernels, "metal_available", lambda: True)
    assert kernels.use_fast_verify(m.model) == []
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and "Metal gated-delta-net verify kernel" in warnings[0]
    assert gdn.set_gdn_verify_impl(gdn.stepwise_verify) is gdn.stepwise_verify
    monkeypatch.setattr(kernels, "gdn_verify_metal", gdn.stepwise_verify)
    monkeypatch.setattr(kernels, "gdn_plain_metal", mlx_lms_own)
    try:  # mlx-lm runs its own Metal kernel outside verify passes: that stays
        assert kernels.use_fast_verify(m.model) == ["gdn_verify"]
    finally:
        gdn.set_gdn_verify_impl(gdn.stepwise_verify)
    assert gdn.set_gdn_plain_impl(None) is None


# ---------------------------------------------------------------------------------------
# The multi-row quantized matmul.


def emulated_qmv(x, w, scales, biases, *, group_size, columns=1):
    """The kernel's arithmetic in numpy: per output feature, per 32-weight chunk,
    scale * sum(x * q) + bias * sum(x), summed in float32 (MLX's nibble order)."""
    x = np.asarray(x.astype(mx.float32), np.float32).reshape(-1, x.shape[-1])
    words = np.asarray(w).astype(np.uint32)
    q = np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(words.shape[0], -1)
    s = np.repeat(np.asarray(scales.astype(mx.float32)), group_size // 32, axis=1)
    bb = np.repeat(np.asarray(biases.astype(mx.float32)), group_size // 32, axis=1)
    chunks = q.shape[1] // 32
    qc = q.reshape(q.shape[0], chunks, 32).astype(np.float32)
    xc = x.reshape(x.shape[0], chunks, 32)
    dot = np.einsum("rcj,ncj->rnc", xc, qc)
    xsum = xc.sum(axis=-1)[:, None, :]
    return (s[None] * dot + bb[None] * xsum).sum(axis=-1)


@pytest.mark.parametrize(
    ("rows", "n", "k", "group_size"),
    [(2, 64, 1024, 64), (5, 96, 2560, 64), (3, 32, 512, 32), (4, 16, 256, 128)],
)
def test_the_kernels_arithmetic_is_mlx_quantized_matmul(
    rows: int, n: int, k: int, group_size: int
) -> None:  # noqa: E501
    """Nibble order, group indexing and the scale/bias split the kernel uses give
    `mx.quantized_matmul`'s product (float32, so only summation order differs)."""
    w = mx.random.normal((n, k), key=mx.random.key(1)) * 0.05
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=4)
    x = mx.random.normal((1, rows, k), key=mx.random.key(2))
    expected = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group_size,
                                   bits=4)  # fmt: skip
    ours = emulated_qmv(x, wq, scales, biases, group_size=group_size)
    np.testing.assert_allclose(ours, np.array(expected).reshape(rows, n), atol=2e-4, rtol=2e-4)
    assert qmv.kernel_shape_ok(bits=4, group_size=group_size, mode="affine", n=n, k=k,
                               biased=True)  # fmt: skip


def test_rows_and_shapes_the_kernel_takes() -> None:
    assert qmv.rows_of((1, 3, 1024)) == 3 and qmv.rows_of((2, 2, 64)) == 4
    assert qmv.rows_of((1024,)) == 1
    assert not qmv.kernel_shape_ok(bits=8, group_size=64, mode="affine", n=64, k=1024, biased=True)
    assert not qmv.kernel_shape_ok(bits=4, group_size=32, mode="mxfp4", n=64, k=1024, biased=False)
    assert not qmv.kernel_shape_ok(bits=4, group_size=64, mode="affine", n=64, k=96, biased=True)
    launch = qmv.launch_config(3, 1000)
    assert launch == {"grid": (32, 1000, 1), "threadgroup": (32, qmv.WARPS_PER_BLOCK, 1)}
    assert qmv.launch_config(2, 6)["threadgroup"] == (32, 6, 1)
    assert qmv.launch_config(2, 1000, columns=4)["grid"] == (32, 250, 1)


def _quantized_pair() -> nn.Module:
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 64, bias=False), nn.Linear(256, 32))
    nn.quantize(model, group_size=64, bits=4)
    return model


def test_routes_follow_the_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A (matrix, rows) is timed on its first verify pass and takes the kernel where that
    took at most MARGIN of MLX's time; a failing timing keeps MLX's; each is timed once;
    rows outside 2..MAX_ROWS are never timed, 2 rows only for very wide matrices."""
    monkeypatch.setattr(routing, "ROUTES", {})
    monkeypatch.setattr(routing, "_POLICY", [routing.MEASURED])
    monkeypatch.setattr(
        qmv, "multi_row_qmv", lambda x, w, *a, **k: mx.zeros((*x.shape[:-1], w.shape[0]))
    )
    timed: list[tuple[int, int]] = []

    def timer(module, lead):  # the 64x256 matrix: the kernel wins from 3 rows on
        n, k = module["weight"].shape[0], routing.route_key(module, 1)[1]
        rows = qmv.rows_of((*lead, 1))
        timed.append((n, rows))
        if n == 32:
            raise RuntimeError("no kernel for this shape")
        return 1.0, (0.85 if (k == 256 and rows >= 3) else 0.95)

    monkeypatch.setattr(routing, "time_both", timer)
    model = _quantized_pair()
    first, second, third = model.layers
    model.layers = [first, second]
    assert routing.route_quantized_layers(model) == 2
    assert type(first) is nn.QuantizedLinear  # swapped in only inside a verify pass
    assert routing.ROUTES == {}
    with routing.multi_row_matmuls(model):
        for rows in (1, 2, 3, 4, 6):
            model(mx.ones((1, rows, 256)))
            third(mx.ones((1, rows, 256)))  # not tapped in this model: never routed
    summary = routing.routes_summary()
    assert summary == {"64x256@2": False, "64x256@3": True, "64x256@4": True,
                       "64x64@2": False, "64x64@3": False, "64x64@4": False}  # fmt: skip
    assert sorted(timed) == sorted((n, r) for n in (64, 64) for r in (3, 4))
    with routing.multi_row_matmuls(model):
        model(mx.ones((1, 3, 256)))
    assert len(timed) == 4  # the first timings hold
    assert routing.takes_kernel(third, mx.ones((1, 3, 256))) is False  # a failed timing
    assert routing.takes_kernel(first, mx.ones((1, 5, 256))) is True
    assert routing.takes_kernel(second, mx.ones((1, 5, 64))) is False
    assert routing.route_quantized_layers(model, measure=False) == 2
    assert routing.takes_kernel(third, mx.ones((1, 5, 256))) is True  # MTPKIT_QMV=1: untimed


def test_rows_past_the_fma_variants_are_routed_only_to_the_tensor_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch's verify (batch x (depth + 1) rows) gives a matrix 6..MMA_MAX_ROWS rows: timed
    and routed only where the tensor-core variant takes them (bfloat16 rows, scales and
    biases); float32 rows past MAX_ROWS, or rows past MMA_MAX_ROWS, stay with MLX's."""
    monkeypatch.setattr(routing, "ROUTES", {})
    monkeypatch.setattr(routing, "_POLICY", [routing.MEASURED])
    timed: list[tuple[int, ...]] = []

    def timer(module: nn.Module, lead: tuple[int, ...]) -> tuple[float, float]:
        timed.append(lead)  # timed on the pass's own layout of its rows
        return 1.0, 0.5

    monkeypatch.setattr(routing, "time_both", timer)
    layer = nn.Linear(256, 64)
    layer.set_dtype(mx.bfloat16)
    model = nn.Sequential(layer)
    nn.quantize(model, group_size=64, bits=4)
    tapped = model.layers[0]
    assert tapped["scales"].dtype == mx.bfloat16
    for rows in (6, 8, 12, 16):
        assert routing.takes_kernel(tapped, mx.ones((rows // 2, 2, 256), dtype=mx.bfloat16))
    assert not routing.takes_kernel(tapped, mx.ones((1, 17, 256), dtype=mx.bfloat16))
    assert not routing.takes_kernel(tapped, mx.ones((1, 6, 256), dtype=mx.float32))
    # Timed once per tile of 8 rows the kernel is built for (6 and 8: 8; 12 and 16: 16).
    assert timed == [(3, 2), (6, 2)]
    assert sorted(routing.routes_summary()) == ["64x256@16", "64x256@8"]
    f32 = _quantized_pair().layers[0]  # float32 scales: the FMA variant's rows only
    assert not routing.takes_kernel(f32, mx.ones((1, 6, 256)))
    assert len(timed) == 2


def test_a_pass_swaps_in_only_the_layers_routed_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once every layer has its route for a row count, a verify pass of that many rows swaps
    in only the layers routed to the kernel; a new route works the lists out again."""
    monkeypatch.setattr(routing, "ROUTES", {})
    monkeypatch.setattr(routing, "_POLICY", [routing.MEASURED])
    monkeypatch.setattr(
        qmv, "multi_row_qmv", lambda x, w, *a, **k: mx.zeros((*x.shape[:-1], w.shape[0]))
    )
    monkeypatch.setattr(
        routing,
        "time_both",
        lambda module, rows: (
            1.0,
            0.5
            if module["weight"].shape[0] == 64 and routing.route_key(module, 1)[1] == 256
            else 1.0,
        ),
    )
    model = _quantized_pair()
    unused = model.layers.pop()  # tapped, never called (as an untied model's embedding matrix)
    model.spare = unused
    first, second = model.layers

    def swapped(rows: int) -> list[bool]:
        with routing.multi_row_matmuls(model, rows):
            flags = [
                type(layer) is routing.RowsQuantizedLinear for layer in (first, second, unused)
            ]
            model(mx.ones((1, rows, 256)))
        return flags

    assert routing.route_quantized_layers(model) == 3
    assert swapped(3) == [True, True, True]  # undecided: all, and the pass decides them
    assert swapped(3) == [True, False, False]  # 64x64 stays with MLX's; the unused one too
    assert swapped(2) == [True, True, True]
    assert swapped(2) == [False, False, False] and swapped(3) == [True, False, False]
    assert [type(layer) for layer in (first, second, unused)] == [nn.QuantizedLinear] * 3


def test_tapped_layers_route_only_the_verify_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `multi_row_matmuls(model)`, 2..5 rows go to the kernel (emulated here) and give
    the stock layer's output; one row, six rows, or outside the block: the stock path, and
    outside it the layers are stock mlx-lm classes again."""
    routed: list[int] = []

    def fake_kernel(x, w, scales, biases, *, group_size, columns=1, variant="fma"):
        assert variant == "fma"  # float32 scales: not the bfloat16 tensor-core variant
        routed.append(qmv.rows_of(x.shape))
        out = emulated_qmv(x, w, scales, biases, group_size=group_size)
        return mx.array(out).reshape(*x.shape[:-1], w.shape[0])

    monkeypatch.setattr(qmv, "multi_row_qmv", fake_kernel)
    monkeypatch.setattr(routing, "ROUTES", {})
    monkeypatch.setattr(routing, "_POLICY", [routing.MEASURED])
    model = _quantized_pair()
    model.layers.pop()
    stock = [type(layer) for layer in model.layers]
    assert routing.route_quantized_layers(model, measure=False) == 2
    assert [type(layer) for layer in model.layers] == stock
    x = mx.random.normal((1, 3, 256), key=mx.random.key(3))
    expected = model(x)
    assert routed == []
    for rows in (1, 3, 6):
        with routing.multi_row_matmuls(model):
            assert all(type(layer) is routing.RowsQuantizedLinear for layer in model.layers)
            got = model(mx.random.normal((1, rows, 256)))
        assert got.shape == (1, rows, 64)
    assert [type(layer) for layer in model.layers] == stock
    assert routed == [3, 3]
    with routing.multi_row_matmuls(model):
        with routing.multi_row_matmuls(model):  # nested (a replayed cache inside a verify)
            got = model(x)
        assert type(model.layers[0]) is routing.RowsQuantizedLinear
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-4, rtol=1e-4)
    with routing.multi_row_matmuls(_quantized_pair()):  # another model: nothing of this one
        model(x)
    assert routed == [3, 3, 3, 3]


# ---------------------------------------------------------------------------------------
# The sources.


def test_sources_name_only_their_inputs() -> None:
    for make in (kernels.gdn_cuda_source, kernels.gdn_metal_source):
        plain, masked = make(masked=False, vectorized=False), make(masked=True, vectorized=False)
        assert "mask" not in plain and "mask[b_idx * T + t]" in masked
        assert "hv_idx) * Dk +" in make(masked=False, vectorized=True)
        assert "states[t * state_size + row" in plain
        assert "q_shape[1]" in plain and "constexpr int T" not in plain
        assert "states[t * state_size" not in make(masked=False, vectorized=False, every=False)


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no CUDA toolkit (nvcc)")
def test_cuda_sources_compile(tmp_path: Path) -> None:
    """Every kernel variant, wrapped the way MLX's CUDA backend wraps it, compiles."""
    units = []
    for masked in (False, True):
        for vec in (False, True):
            inputs = [
                ("q", "bfloat16"),
                ("k", "bfloat16"),
                ("v", "bfloat16"),
                ("g", "float32"),
                ("beta", "bfloat16"),
                ("state_in", "float32"),
            ]
            inputs += [("mask", "bool")] if masked else []
            units.append(cuda_source.wrap(
                f"gdn_{int(masked)}{int(vec)}", kernels.gdn_cuda_source(masked=masked,
                vectorized=vec), kernels.WARP_SUM_HEADER, inputs,
                [("y", "bfloat16"), ("states", "float32")],
                [("InT", "bfloat16"), ("StT", "float32"), ("Hk", 16), ("Hv", 32), ("Dk", 128),
                 ("Dv", 128)],
            ))  # fmt: skip
    for rows, columns, dtype in ((2, 1, "bfloat16"), (5, 2, "bfloat16"), (3, 1, "float32")):
        units.append(cuda_source.wrap(
            f"qmv_{rows}{columns}{dtype}", qmv.SOURCE, qmv.HEADER,
            [("x", dtype), ("w", "uint32"), ("scales", dtype), ("biases", dtype)],
            [("out", dtype)],
            [("R", rows), ("C", columns), ("K", 2560), ("N", 9216), ("GS", 64),
             ("OutT", dtype)],
        ))  # fmt: skip
    units.append(cuda_source.wrap(
        "qmv_mma", qmv.MMA_SOURCE, qmv.MMA_HEADER,
        [("x", "bfloat16"), ("w", "uint32"), ("scales", "bfloat16"), ("biases", "bfloat16")],
        [("out", "bfloat16")],
        [("R", 5), ("K", 2560), ("N", 9216), ("GS", 64), ("OutT", "bfloat16"),
         ("SPLIT", qmv.SPLIT_K), ("SEGMENT", qmv.SEGMENT)],
    ))  # fmt: skip
    cuda_source.compile_units(units, tmp_path)


# ---------------------------------------------------------------------------------------
# The CUDA sources run on the CPU (tests/cuda_emulator.py): their logic, not their speed.


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch):
    """`mx.fast.cuda_kernel` replaced by the CPU emulator of the same source."""
    if cuda_emulator.gxx() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_emulator.EmulatedKernel)
    built = (kernels.cuda_verify_kernel, qmv.cuda_qmv_kernel, qmv.cuda_qmv_mma_kernel)
    for kernel in built:
        kernel.cache_clear()
    yield
    for kernel in built:
        kernel.cache_clear()


@pytest.fixture
def emulated_metal(monkeypatch: pytest.MonkeyPatch):
    """`mx.fast.metal_kernel` replaced by the CPU emulator of the same source."""
    if cuda_emulator.gxx() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(mx.fast, "metal_kernel", cuda_emulator.EmulatedMetalKernel)
    kernels.metal_verify_kernel.cache_clear()
    yield
    kernels.metal_verify_kernel.cache_clear()


@pytest.mark.parametrize(
    ("T", "hk", "hv", "dv", "dtype", "masked", "per_channel"),
    [(3, 2, 4, 8, mx.float32, False, False), (4, 1, 2, 6, mx.bfloat16, True, False),
     (2, 2, 4, 4, mx.float32, False, True)],
)  # fmt: skip
def test_the_cuda_verify_kernel_is_the_recurrence(emulated_cuda, T, hk, hv, dv, dtype, masked,
                                                  per_channel) -> None:  # noqa: N803  # fmt: skip
    """The CUDA source (emulated) gives the float32 recurrence's output and every
    position's state: grouped heads, value rows not a multiple of the block, bf16 inputs,
    padding masks, per-channel decay."""
    q, k, v, a, b, A_log, dt_bias, state = gdn_inputs(T, hk, hv, 64, dv, per_channel=per_channel)  # noqa: N806, E501
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    mask = mx.array([[True, False] + [True] * (T - 2)]) if masked else None
    y, states = kernels.gdn_verify_cuda(gated_delta_update, q, k, v, a, b, A_log, dt_bias, state,
                                        mask)  # fmt: skip
    ref_y, ref_states = numpy_gated_delta(
        *(np.array(t.astype(mx.float32)) for t in (q, k, v, a, b, A_log, dt_bias, state)),
        None if mask is None else np.array(mask),
    )
    assert y.dtype == dtype and len(states) == T
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), ref_y, atol=tol, rtol=tol)
    for t in range(T):
        np.testing.assert_allclose(np.array(states[t]), ref_states[t], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("rows", "T", "masked"), [(3, 5, True), (2, 1, False), (1, 4, False)])
def test_the_last_state_kernel_is_the_recurrence(emulated_cuda, rows, T, masked) -> None:  # noqa: N803
    """Outside a verify pass (a prefill chunk, a plain step) the CUDA source (emulated)
    writes only the last state: each row's output and last state are the float32
    recurrence's, at widths and lengths one build serves (read from the shapes at run
    time), left padding masked as a batch's prefill masks it."""
    inputs = gdn_inputs(T, 2, 4, 64, 8, seed=rows, rows=rows)
    mask = None
    if masked:  # row r has r padded positions first
        mask = mx.array([[t >= r for t in range(T)] for r in range(rows)])
    y, last = kernels.gdn_plain_cuda(gated_delta_update, *inputs, mask)
    assert y.shape == (rows, T, 4, 8) and last.shape == inputs[-1].shape
    for r in range(rows):
        row = [np.array(t[r : r + 1]) if t.ndim > 1 else np.array(t) for t in inputs]
        ref_y, ref_states = numpy_gated_delta(
            *row, None if mask is None else np.array(mask[r : r + 1])
        )
        kept = [t for t in range(T) if mask is None or bool(mask[r, t])]
        np.testing.assert_allclose(np.array(y[r : r + 1])[:, kept], ref_y[:, kept], atol=1e-5)
        np.testing.assert_allclose(np.array(last[r : r + 1]), ref_states[-1], atol=1e-5,
                                   rtol=1e-4)  # fmt: skip


def test_one_build_serves_every_width_and_length(emulated_cuda, monkeypatch) -> None:
    """B and T are not template constants: verify passes and plain calls of other widths
    and lengths build no other kernel (on CUDA each would be an NVRTC build on first use)."""
    templates = []
    call = cuda_emulator.EmulatedKernel.__call__

    def recorded(self, **kwargs):
        templates.append((self.name, tuple(kwargs["template"])))
        return call(self, **kwargs)

    monkeypatch.setattr(cuda_emulator.EmulatedKernel, "__call__", recorded)
    for rows, T in ((1, 2), (3, 4)):  # noqa: N806
        inputs = gdn_inputs(T, rows=rows)
        kernels.gdn_verify_cuda(gated_delta_update, *inputs, None)
        kernels.gdn_plain_cuda(gated_delta_update, *inputs, None)
    assert len(templates) == 4 and len(set(templates)) == 2


@pytest.mark.parametrize(
    ("dtype", "masked", "per_channel"), [(mx.bfloat16, True, False), (mx.float32, False, True)]
)
def test_the_metal_twin_is_the_recurrence(emulated_metal, dtype, masked, per_channel) -> None:
    """The Metal source (emulated: no Apple GPU here) gives the same results."""
    T = 3  # noqa: N806
    q, k, v, a, b, A_log, dt_bias, state = gdn_inputs(T, 1, 2, 64, 6, per_channel=per_channel)  # noqa: N806, E501
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    mask = mx.array([[True, False, True]]) if masked else None
    y, states = kernels.gdn_verify_metal(gated_delta_update, q, k, v, a, b, A_log, dt_bias,
                                         state, mask)  # fmt: skip
    ref_y, ref_states = numpy_gated_delta(
        *(np.array(t.astype(mx.float32)) for t in (q, k, v, a, b, A_log, dt_bias, state)),
        None if mask is None else np.array(mask),
    )
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), ref_y, atol=tol, rtol=tol)
    for t in range(T):
        np.testing.assert_allclose(np.array(states[t]), ref_states[t], atol=1e-5, rtol=1e-4)


def test_a_verify_pass_with_the_emulated_kernel_is_the_references(emulated_cuda, monkeypatch):
    """Installed as on a CUDA device (its self-check passing), the kernel gives a verify
    pass the reference's logits and rollback states."""
    m = load_model(EXAMPLE, with_head=False)
    cache = m.make_cache()
    m.forward(mx.array([[1, 2, 3, 4]]), cache)
    saved = [list(c.cache) if gdn.is_recurrent_cache(c) else None for c in cache]
    reference = m.verify(mx.array([5, 6, 7]), cache)
    mx.eval(reference.logits, reference.snapshots.states)
    for c, kept in zip(cache, saved, strict=True):
        if kept is None:
            c.trim(3)
        else:
            c.cache = kept
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    try:
        assert kernels.use_fast_verify(m.model) == ["gdn_verify", "gdn_plain"]
        fused = m.verify(mx.array([5, 6, 7]), cache)
        fresh = m.make_cache()  # a prefill and a plain step through the last-state kernel
        prefill, _ = m.forward(mx.array([[1, 2, 3, 4]]), fresh)
        step, _ = m.forward(mx.array([[5]]), fresh)
    finally:
        gdn.set_gdn_verify_impl(gdn.stepwise_verify)
        gdn.set_gdn_plain_impl(None)
    assert mx.allclose(fused.logits, reference.logits, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(fused.snapshots.states, reference.snapshots.states, strict=True):
        for s, r in zip(ours, theirs, strict=True):
            assert mx.allclose(s, r, atol=1e-5, rtol=1e-4)
    stock = m.make_cache()  # mlx-lm's own ops, as on this CPU
    expected, _ = m.forward(mx.array([[1, 2, 3, 4]]), stock)
    assert mx.allclose(prefill, expected, atol=1e-4, rtol=1e-4)
    expected, _ = m.forward(mx.array([[5]]), stock)
    assert mx.allclose(step, expected, atol=1e-4, rtol=1e-4)
    for ours, theirs in zip(fresh, stock, strict=True):
        if gdn.is_recurrent_cache(ours):
            assert mx.allclose(ours.cache[1], theirs.cache[1], atol=1e-5, rtol=1e-4)


def test_a_batchs_verify_takes_the_kernel_for_its_rows(emulated_cuda, monkeypatch) -> None:
    """A batch's verify pass [B, K+1] sends its B x (K+1) rows through the routed layers'
    kernel (every layer routed, as MTPKIT_QMV=1) and gives the logits and hidden states of
    the same pass through MLX's quantized matmul (float32: summation order only)."""
    from mtpkit.runtime.rollback.rows import batch_caches
    from mtpkit.runtime.rollback.verify_rows import verify_rows

    m = load_model(EXAMPLE, with_head=False)
    m.model.set_dtype(mx.float32)  # float32 rows: the FMA variant, summation order only
    nn.quantize(m.model, group_size=32, bits=4, class_predicate=lambda path, mod: ".mlp." in path
                and isinstance(mod, nn.Linear) and mod.weight.shape[-1] % 32 == 0)  # fmt: skip
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]

    def prefilled() -> list:
        single = []
        for prompt in prompts:
            cache = m.make_cache()
            mx.eval(m.forward(mx.array([prompt]), cache)[0])
            single.append(cache)
        return batch_caches(single)

    tokens = mx.array([[9, 10], [11, 12]])  # (the MLPs quantized: the emulator is slow)
    reference = verify_rows(m, tokens, prefilled())  # nothing tapped: MLX's matmul
    mx.eval(reference.logits, reference.hidden)
    calls: list[tuple[int, ...]] = []
    product = qmv.multi_row_qmv

    def counted(x, *args, **kwargs):
        calls.append(x.shape)
        return product(x, *args, **kwargs)

    monkeypatch.setattr(qmv, "multi_row_qmv", counted)
    monkeypatch.setattr(routing, "ROUTES", {})
    monkeypatch.setattr(routing, "_POLICY", [routing.MEASURED])  # set to ALL just below
    assert routing.route_quantized_layers(m.model, measure=False) > 0
    routed = verify_rows(m, tokens, prefilled())
    mx.eval(routed.logits, routed.hidden)
    assert calls and all(shape[:-1] == (2, 2) for shape in calls)
    for ours, theirs in ((routed.logits, reference.logits), (routed.hidden, reference.hidden)):
        ours, theirs = (np.array(a.astype(mx.float32)) for a in (ours, theirs))
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("rows", "n", "k", "group_size", "columns"), [(2, 16, 1536, 64, 1), (5, 8, 1024, 128, 2)]
)
def test_the_cuda_qmv_is_the_quantized_product(emulated_cuda, rows, n, k, group_size,
                                               columns) -> None:  # fmt: skip
    """The CUDA source (emulated) on bf16 rows and bf16 scales: within one bf16 rounding of
    the float32 product of the dequantized weights; on float32 inputs it is
    `mx.quantized_matmul`'s product up to summation order."""
    w = mx.random.normal((n, k), key=mx.random.key(4)) * k**-0.5
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=group_size, bits=4)
    x = mx.random.normal((1, rows, k), key=mx.random.key(5)).astype(mx.bfloat16)
    out = qmv.multi_row_qmv(x, wq, scales, biases, group_size=group_size, columns=columns)
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    deq = mx.dequantize(wq, s32, b32, group_size=group_size, bits=4)  # float32: s * q + b exact
    ref = np.array(x.astype(mx.float32) @ deq.T)
    assert out.shape == (1, rows, n) and out.dtype == mx.bfloat16
    got = np.array(out.astype(mx.float32))
    np.testing.assert_allclose(got, ref, rtol=2**-8, atol=1e-5)
    x32 = x.astype(mx.float32)
    out32 = qmv.multi_row_qmv(x32, wq, s32, b32, group_size=group_size, columns=columns)
    stock = mx.quantized_matmul(x32, wq, s32, b32, transpose=True, group_size=group_size, bits=4)
    np.testing.assert_allclose(np.array(out32), np.array(stock), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("rows", "n", "k", "group_size"),
    [(2, 32, 1536, 64), (5, 16, 512, 128), (8, 16, 512, 64), (11, 32, 256, 64), (16, 16, 512, 128)],
)
def test_the_tensor_core_qmv_is_the_bf16_product(emulated_cuda, rows, n, k, group_size) -> None:
    """The mma variant (emulated: the PTX ISA's m16n8k16 fragment layouts) rounds each
    dequantized weight to bfloat16 once and sums in float32: within a bf16 rounding of the
    float32 product of the exact weights s * q + b, over split-K warps' shares; past 8 rows
    in two tiles of rows sharing the weights (a batch's verify)."""
    w = mx.random.normal((n, k), key=mx.random.key(6)) * k**-0.5
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=group_size, bits=4)
    x = mx.random.normal((1, rows, k), key=mx.random.key(7)).astype(mx.bfloat16)
    assert qmv.mma_shape_ok(rows=rows, n=n, k=k, group_size=group_size,
                            dtypes=(x.dtype, scales.dtype, biases.dtype))  # fmt: skip
    out = qmv.multi_row_qmv(x, wq, scales, biases, group_size=group_size, variant="mma")
    s32, b32 = scales.astype(mx.float32), biases.astype(mx.float32)
    deq = mx.dequantize(wq, s32, b32, group_size=group_size, bits=4)
    ref = np.array(x.astype(mx.float32) @ deq.T)
    assert out.shape == (1, rows, n) and out.dtype == mx.bfloat16
    got = np.array(out.astype(mx.float32))
    np.testing.assert_allclose(got, ref, rtol=2**-8, atol=2**-8 * np.abs(ref).max())


# -- attention of a few queries without a per-length build ---------------------------------
def _attention_reference(q, k, v, scale, mask) -> np.ndarray:
    """float64 numpy: softmax(q k^T * scale + mask) v, grouped-query heads repeated."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    length, keys = q.shape[2], k.shape[2]
    if isinstance(mask, str):
        mask = np.arange(keys - length, keys)[:, None] >= np.arange(keys)[None]
    if mask is not None:
        mask = np.asarray(mask)
        scores = np.where(mask, scores, -np.inf) if mask.dtype == bool else scores + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("hq,hk,d,dv", [(4, 2, 32, 32), (8, 8, 128, 128), (8, 2, 192, 128)])
@pytest.mark.parametrize("length", [2, 4])
def test_few_query_attention_is_attention(hq: int, hk: int, d: int, dv: int, length: int) -> None:
    """`attention_by_ops` against float64 numpy, for every mask mlx-lm passes: none, causal
    (queries at the end of the keys), boolean [L, S] (rotating caches), additive per head."""
    from mtpkit.runtime.kernels.attention import attention_by_ops

    keys = 37
    ks = mx.random.split(mx.random.key(length), 5)
    q = mx.random.normal((1, hq, length, d), key=ks[0])
    k = mx.random.normal((1, hk, keys, d), key=ks[1])
    v = mx.random.normal((1, hk, keys, dv), key=ks[2])
    masks = [None, "causal", mx.random.uniform(shape=(length, keys), key=ks[3]) > 0.3,
             mx.random.normal((1, hq, length, keys), key=ks[4])]  # fmt: skip
    for mask in masks:
        out = attention_by_ops(q, k, v, scale=d**-0.5, mask=mask)
        ref = _attention_reference(q, k, v, d**-0.5, mask)
        assert out.shape == (1, hq, length, dv)
        assert np.abs(np.asarray(out) - ref).max() < 1e-4, mask


def test_few_query_attention_takes_only_a_few_queries_and_only_inside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside the block 2..MAX_QUERIES queries go to the ops (no call to MLX's), one query,
    longer calls and attention sinks to MLX's; outside, and off CUDA unforced, MLX's."""
    from mtpkit.runtime.kernels import attention

    calls = []
    original = mx.fast.scaled_dot_product_attention

    def mlxs(q, k, v, *, scale, mask=None, **kwargs):
        calls.append(q.shape[2])
        return original(q, k, v, scale=scale, mask=mask, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", mlxs)
    k = v = mx.zeros((1, 2, 40, 32))

    def attend(length: int, **kwargs) -> None:
        q = mx.zeros((1, 2, length, 32))
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal", **kwargs))

    with attention.few_query_attention(force=True):
        for length in (1, 2, 3, attention.MAX_QUERIES, attention.MAX_QUERIES + 1):
            attend(length)
        attend(3, sinks=mx.zeros((2,)))
    assert calls == [1, attention.MAX_QUERIES + 1, 3]
    with attention.few_query_attention():  # the CPU: nothing changes
        attend(2)
    attend(3)
    assert calls[3:] == [2, 3] and mx.fast.scaled_dot_product_attention is mlxs


# ---------------------------------------------------------------------------------------
# A prompt's chunk without a build per length (`kernels.prompt`).


def test_the_depthwise_conv_by_ops_is_mlxs_conv() -> None:
    """The shifted products give mlx's depthwise conv1d (the gated-delta-net's: kernel 4,
    one channel a group), in float32 and in bfloat16 to its rounding."""
    from mtpkit.runtime.kernels import prompt

    x = mx.random.normal((2, 37, 24), key=mx.random.key(1))
    w = mx.random.normal((24, 4, 1), key=mx.random.key(2))
    expected = mx.conv1d(x, w, groups=24)
    assert mx.allclose(prompt.depthwise_conv1d_by_ops(x, w), expected, atol=1e-5)
    xb, wb = x.astype(mx.bfloat16), w.astype(mx.bfloat16)
    ours = prompt.depthwise_conv1d_by_ops(xb, wb)
    assert ours.dtype == mx.bfloat16
    assert mx.allclose(ours.astype(mx.float32), mx.conv1d(xb, wb, groups=24).astype(mx.float32),
                       atol=5e-2, rtol=2e-2)  # fmt: skip


def test_a_prompt_chunk_through_the_routes_is_the_models_forward(monkeypatch) -> None:
    """Routed as on CUDA (forced here), a prefill chunk gives mlx-lm's logits and caches:
    the conv1d and the long attention computed from ops, shorter calls left to MLX, and
    nothing routed where the scores would pass the budget; outside the block MLX's again."""
    from mtpkit.runtime.kernels import prompt

    m = load_model(EXAMPLE, with_head=False)
    m.model.set_dtype(mx.float32)
    ids = mx.array([list(range(3, 43))])
    stock_cache = m.make_cache()
    expected = m.model(ids, cache=stock_cache)
    calls: list[str] = []
    conv, sdpa = prompt.depthwise_conv1d_by_ops, prompt.attention_by_ops
    monkeypatch.setattr(prompt, "depthwise_conv1d_by_ops",
                        lambda *a: calls.append("conv") or conv(*a))  # fmt: skip
    monkeypatch.setattr(prompt, "attention_by_ops",
                        lambda *a, **k: calls.append("attention") or sdpa(*a, **k))  # fmt: skip
    cache = m.make_cache()
    with prompt.prompt_chunk(force=True):
        routed = m.model(ids, cache=cache)
        short = m.model(mx.array([[5, 6]]), cache=m.make_cache())
    assert "conv" in calls and "attention" in calls
    assert calls.count("attention") == 1  # the 2-token call kept MLX's attention
    assert mx.allclose(routed, expected, atol=1e-4, rtol=1e-4)
    from mlx.utils import tree_flatten

    for ours, theirs in zip(cache, stock_cache, strict=True):
        pairs = zip(tree_flatten(ours.state), tree_flatten(theirs.state), strict=True)
        arrays = [(a, b) for (_, a), (_, b) in pairs if isinstance(a, mx.array)]
        assert arrays and all(mx.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in arrays)
    assert short.shape[1] == 2
    calls.clear()
    monkeypatch.setattr(prompt, "SCORE_BUDGET", 10)
    with prompt.prompt_chunk(force=True):
        m.model(ids, cache=m.make_cache())
    assert calls.count("attention") == 0 and "conv" in calls
    calls.clear()
    m.model(ids, cache=m.make_cache())  # outside: MLX's own
    assert calls == []
