"""The verify pass's gated-delta-net recurrence as one kernel over all T tokens.

mlx-lm runs a gated-delta-net layer's recurrence (docs/MTP_FORMATS.md, "Rolling back") as
one Metal kernel for T tokens on Apple GPUs, and everywhere else as a Python loop of small
ops per token (`gated_delta_ops`), so on CUDA a T-token verify pays the loop T times; and the
reference verify (`gdn.stepwise_verify`) runs it one token at a time to keep each state.

`gdn_verify_cuda` does the same math in one `mx.fast.cuda_kernel` launch that also writes the
state after every position: its cost barely grows with T, and the rollback states come out of
that same pass. `gdn_verify_metal` is the Metal twin, mirroring mlx-lm's Metal kernel with
the extra per-position state output (it has not run on an Apple GPU: there is none here;
its logic is tested through the CPU emulator, and on a Mac it is installed only behind the
same self-check). `use_fast_verify` installs the CUDA one (through
`gdn.set_gdn_verify_impl`, after a self-check against the reference) when a model is loaded
on a CUDA GPU, and the multi-row quantized matmul (`mtpkit.runtime.kernels.qmv`) where asked; the CPU keeps
`stepwise_verify`. `MTPKIT_KERNELS=0` turns both off.

The same kernel, writing only the last state, runs every other gated-delta-net call on CUDA
(`gdn_plain_cuda`: a prefill chunk, a plain step; `MTPKIT_GDN_PLAIN=0` keeps mlx-lm's ops):
mlx-lm's per-token loop made a prompt's prefill cost host time in proportion to its length
(~100 ms a prompt of a few hundred tokens on the bundled example, one H200). B and T are read
from the inputs' shapes at run time, so one build serves every batch width and length (as
template constants, each new (width, length) was an NVRTC build on first use).

Layouts (mlx-lm's): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] (or [B, T, Hv, Dk]
when the decay is per key channel); beta [B, T, Hv]; state [B, Hv, Dv, Dk] (float32).
Outputs: y [B, T, Hv, Dv] in q's dtype and the states [T, B, Hv, Dv, Dk] in the state dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.environment import switch
from mtpkit.runtime.kernels import qmv, routing
from mtpkit.runtime.rollback.gdn import (
    set_gdn_plain_impl,
    set_gdn_verify_impl,
    stepwise_verify,
    tap_gated_delta_layers,
)

# Keyword arguments of mlx-lm's `gated_delta_update` that the kernels understand.
_KNOWN_KWARGS = {"use_kernel", "lower_bound", "allow_neg_eigval"}

WARP_SUM_HEADER = """
__device__ __forceinline__ float mtpkit_warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
"""


def _gate_access(vectorized: bool, lane: str) -> str:
    """The decay of state element `i` at time t (per head, or per head and key channel)."""
    if vectorized:
        return f"static_cast<float>(g[((b_idx * T + t) * Hv + hv_idx) * Dk + {lane}])"
    return "static_cast<float>(g[(b_idx * T + t) * Hv + hv_idx])"


def gdn_cuda_source(*, masked: bool, vectorized: bool, every: bool = True) -> str:
    """The CUDA body: one warp per (batch * value head, value row); each lane keeps Dk / 32
    elements of that state row in registers (element i * 32 + lane, so loads and stores
    coalesce) and, token after token, decays the row, takes the delta rule step, writes y
    and (`every`) writes the row into the state output of that position, or (not `every`)
    once, after the last. B and T are read from q's shape at run time: one build serves
    every batch width and length."""
    on = "mask[b_idx * T + t]" if masked else "true"
    gate = _gate_access(vectorized, "i * 32 + lane")
    store = "t * state_size + row + i * 32 + lane" if every else "row + i * 32 + lane"
    per_position, last = (_cuda_store(store), "") if every else ("", _cuda_store(store))
    return f"""
    const int B = q_shape[0];
    const int T = q_shape[1];
    const int lane = threadIdx.x;
    const int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    if (dv_idx >= Dv) {{
      return;
    }}
    const int b_idx = n / Hv;
    const int hv_idx = n % Hv;
    const int hk_idx = hv_idx / (Hv / Hk);
    constexpr int per_lane = Dk / 32;
    const long state_size = static_cast<long>(B) * Hv * Dv * Dk;
    const long row = (static_cast<long>(n) * Dv + dv_idx) * Dk;

    float s[per_lane];
#pragma unroll
    for (int i = 0; i < per_lane; ++i) {{
      s[i] = static_cast<float>(state_in[row + i * 32 + lane]);
    }}
    for (int t = 0; t < T; ++t) {{
      const long qk = ((static_cast<long>(b_idx) * T + t) * Hk + hk_idx) * Dk;
      const long vy = ((static_cast<long>(b_idx) * T + t) * Hv + hv_idx) * Dv + dv_idx;
      if ({on}) {{
        float kv_mem = 0.0f;
#pragma unroll
        for (int i = 0; i < per_lane; ++i) {{
          s[i] = s[i] * {gate};
          kv_mem += s[i] * static_cast<float>(k[qk + i * 32 + lane]);
        }}
        kv_mem = mtpkit_warp_sum(kv_mem);
        const float delta = (static_cast<float>(v[vy]) - kv_mem) *
            static_cast<float>(beta[(b_idx * T + t) * Hv + hv_idx]);
        float out = 0.0f;
#pragma unroll
        for (int i = 0; i < per_lane; ++i) {{
          s[i] = s[i] + static_cast<float>(k[qk + i * 32 + lane]) * delta;
          out += s[i] * static_cast<float>(q[qk + i * 32 + lane]);
        }}
        out = mtpkit_warp_sum(out);
        if (lane == 0) {{
          y[vy] = static_cast<InT>(out);
        }}
      }} else if (lane == 0) {{
        y[vy] = static_cast<InT>(0.0f);
      }}{per_position}
    }}{last}
"""


def _cuda_store(index: str) -> str:
    return f"""
#pragma unroll
      for (int i = 0; i < per_lane; ++i) {{
        states[{index}] = static_cast<StT>(s[i]);
      }}"""


def gdn_metal_source(*, masked: bool, vectorized: bool, every: bool = True) -> str:
    """The Metal body: mlx-lm's kernel (one SIMD group per value row, Dk / 32 contiguous
    elements per lane, `simd_sum`) plus the state of every position (`every`) or of the
    last written to `states`; B and T from q's shape at run time, as in the CUDA body."""
    on = "mask[b_idx * T + t]" if masked else "true"
    gate = _gate_access(vectorized, "s_idx")
    store = "t * state_size + row + n_per_t * dk_idx + i" if every else "row + n_per_t * dk_idx + i"
    write = f"""
      for (int i = 0; i < n_per_t; ++i) {{
        states[{store}] = static_cast<StT>(s[i]);
      }}"""
    per_position, last = (write, "") if every else ("", write)
    return f"""
    const int B = q_shape[0];
    const int T = q_shape[1];
    auto n = thread_position_in_grid.z;
    auto b_idx = n / Hv;
    auto hv_idx = n % Hv;
    auto hk_idx = hv_idx / (Hv / Hk);
    constexpr int n_per_t = Dk / 32;
    auto dk_idx = thread_position_in_threadgroup.x;
    auto dv_idx = thread_position_in_grid.y;
    const long state_size = long(B) * Hv * Dv * Dk;
    const long row = (long(n) * Dv + dv_idx) * Dk;

    float s[n_per_t];
    for (int i = 0; i < n_per_t; ++i) {{
      s[i] = static_cast<float>(state_in[row + n_per_t * dk_idx + i]);
    }}
    for (int t = 0; t < T; ++t) {{
      auto qk = ((long(b_idx) * T + t) * Hk + hk_idx) * Dk;
      auto vy = ((long(b_idx) * T + t) * Hv + hv_idx) * Dv + dv_idx;
      if ({on}) {{
        float kv_mem = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {{
          auto s_idx = n_per_t * dk_idx + i;
          s[i] = s[i] * {gate};
          kv_mem += s[i] * static_cast<float>(k[qk + s_idx]);
        }}
        kv_mem = simd_sum(kv_mem);
        auto delta = (static_cast<float>(v[vy]) - kv_mem) *
            static_cast<float>(beta[(b_idx * T + t) * Hv + hv_idx]);
        float out = 0.0f;
        for (int i = 0; i < n_per_t; ++i) {{
          auto s_idx = n_per_t * dk_idx + i;
          s[i] = s[i] + static_cast<float>(k[qk + s_idx]) * delta;
          out += s[i] * static_cast<float>(q[qk + s_idx]);
        }}
        out = simd_sum(out);
        if (thread_index_in_simdgroup == 0) {{
          y[vy] = static_cast<InT>(out);
        }}
      }} else if (thread_index_in_simdgroup == 0) {{
        y[vy] = static_cast<InT>(0);
      }}{per_position}
    }}{last}
"""


def _input_names(masked: bool) -> list[str]:
    return ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])


def _kernel_name(masked: bool, vectorized: bool, every: bool) -> str:
    suffix = ("_vec" if vectorized else "") + ("_mask" if masked else "")
    return ("mtpkit_gdn_verify" if every else "mtpkit_gdn_last") + suffix


@functools.cache
def cuda_verify_kernel(masked: bool, vectorized: bool, every: bool = True) -> Any:
    """The CUDA kernel object for one variant (built once; MLX compiles it on first use,
    once per dtype and head shape)."""
    return mx.fast.cuda_kernel(
        name=_kernel_name(masked, vectorized, every),
        input_names=_input_names(masked),
        output_names=["y", "states"],
        source=gdn_cuda_source(masked=masked, vectorized=vectorized, every=every),
        header=WARP_SUM_HEADER,
    )


@functools.cache
def metal_verify_kernel(masked: bool, vectorized: bool, every: bool = True) -> Any:
    """The Metal kernel object for one variant."""
    return mx.fast.metal_kernel(
        name=_kernel_name(masked, vectorized, every),
        input_names=_input_names(masked),
        output_names=["y", "states"],
        source=gdn_metal_source(masked=masked, vectorized=vectorized, every=every),
    )


def gates(a, b, A_log, dt_bias, *, lower_bound=None, allow_neg_eigval=False, **_):  # noqa: N803
    """The decay g and the step size beta, as mlx-lm's `gated_delta_update` computes them."""
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        return compute_g(A_log, a, dt_bias), beta
    return compute_lower_bound_g(A_log, a, dt_bias, lower_bound), beta


def kernel_supports(q: mx.array, v: mx.array, kwargs: dict[str, Any]) -> bool:
    """Shapes and options the kernels handle (others take the reference path)."""
    dk, hk, hv = q.shape[-1], q.shape[-2], v.shape[-2]
    return dk % 32 == 0 and hv % hk == 0 and set(kwargs) <= _KNOWN_KWARGS


def _launch(kernel_of, threadgroup, q, k, v, a, b, A_log, dt_bias, state, mask, kwargs, every=True):  # noqa: N803, E501
    g, beta = gates(a, b, A_log, dt_bias, **kwargs)
    B, T, Hk, Dk = k.shape  # noqa: N806
    Hv, Dv = v.shape[2:]  # noqa: N806
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    inputs = [q, k, v, g, beta, state] + ([mask] if mask is not None else [])
    y, states = kernel_of(mask is not None, g.ndim == 4, every)(
        inputs=inputs,
        template=[("InT", q.dtype), ("StT", state.dtype), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk),
                  ("Dv", Dv)],
        grid=(32, Dv, B * Hv),
        threadgroup=threadgroup,
        output_shapes=[(B, T, Hv, Dv), (T if every else 1, *state.shape)],
        output_dtypes=[q.dtype, state.dtype],
    )  # fmt: skip
    # [T, B, Hv, Dv, Dk] (`gdn.state_after` takes a row as a view), or [1, ...]: the last.
    return y, states


def gdn_verify_cuda(
    original: Callable[..., Any], q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs
):  # noqa: N803, E501
    """`gdn.stepwise_verify`'s results from one CUDA kernel launch over all T tokens (the
    states as one array [T, ...])."""
    if not kernel_supports(q, v, kwargs):
        return stepwise_verify(original, q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    return _launch(
        cuda_verify_kernel, (32, 4, 1), q, k, v, a, b, A_log, dt_bias, state, mask, kwargs
    )


def gdn_verify_metal(
    original: Callable[..., Any], q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs
):  # noqa: N803, E501
    """The Metal twin of `gdn_verify_cuda` (not run yet: written for Apple GPUs)."""
    if not kernel_supports(q, v, kwargs):
        return stepwise_verify(original, q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    return _launch(
        metal_verify_kernel, (32, 4, 1), q, k, v, a, b, A_log, dt_bias, state, mask, kwargs
    )


def gdn_plain_cuda(
    original: Callable[..., Any], q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs
):  # noqa: N803, E501
    """mlx-lm's `gated_delta_update` outside a verify pass (a prefill chunk, a plain step)
    from one CUDA launch over all T tokens, only the last state written: where mlx-lm's
    CUDA path runs a loop of small ops per token (`gated_delta_ops`)."""
    if not kernel_supports(q, v, kwargs):
        return original(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    y, states = _launch(
        cuda_verify_kernel, (32, 4, 1), q, k, v, a, b, A_log, dt_bias, state, mask, kwargs,
        every=False,
    )  # fmt: skip
    return y, states.reshape(states.shape[1:])


def gdn_plain_metal(
    original: Callable[..., Any], q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs
):  # noqa: N803, E501
    """The Metal twin of `gdn_plain_cuda` (not installed: mlx-lm runs its own Metal kernel
    there already)."""
    if not kernel_supports(q, v, kwargs):
        return original(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
    y, states = _launch(
        metal_verify_kernel, (32, 4, 1), q, k, v, a, b, A_log, dt_bias, state, mask, kwargs,
        every=False,
    )  # fmt: skip
    return y, states.reshape(states.shape[1:])


def cuda_available() -> bool:
    """A CUDA GPU is the default device (MLX's CUDA build)."""
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def self_check(
    impl: Callable[..., Any] | None = None, plain: Callable[..., Any] | None = None
) -> float:  # noqa: E501
    """Largest difference from the reference, on small float32 cases on the default device,
    of `impl` (default: the CUDA verify kernel: outputs and every position's state, at two
    batch widths and lengths, so the shapes read at run time are exercised) and of `plain`
    (default: the CUDA last-state kernel: outputs and the last state, against mlx-lm's own
    update over all the tokens at once)."""
    from mlx_lm.models.gated_delta import gated_delta_update

    impl, plain = impl or gdn_verify_cuda, plain or gdn_plain_cuda
    diffs = []
    for seed, (B, T) in enumerate(((1, 3), (2, 2), (3, 5))):  # noqa: N806
        args = _check_case(seed, B, T)
        y, states = impl(gated_delta_update, *args)
        ref_y, ref_states = stepwise_verify(gated_delta_update, *args)
        diffs += [mx.abs(y - ref_y).max()] + [
            mx.abs(s - r).max() for s, r in zip(states, ref_states, strict=True)
        ]
        y, last = plain(gated_delta_update, *args)
        ref_y, ref_last = gated_delta_update(*args)
        diffs += [mx.abs(y - ref_y).max(), mx.abs(last - ref_last).max()]
    return max(d.item() for d in diffs)


def _check_case(seed: int, B: int, T: int) -> tuple[Any, ...]:  # noqa: N803
    """Random float32 inputs of `gated_delta_update` (2 key heads, 4 value heads)."""
    ks = mx.random.split(mx.random.key(seed), 8)
    Hk, Hv, Dk, Dv = 2, 4, 64, 32  # noqa: N806
    q, k = (mx.random.normal((B, T, Hk, Dk), key=ks[i]) * Dk**-0.5 for i in (0, 1))
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2])
    a, b = (mx.random.normal((B, T, Hv), key=ks[i]) for i in (3, 4))
    A_log, dt_bias = (mx.random.normal((Hv,), key=ks[i]) * 0.5 for i in (5, 6))  # noqa: N806
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[7]) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state, None


# The self-check's bound: float32 sums in another order over Dk = 64 terms.
SELF_CHECK_TOLERANCE = 1e-4


def metal_available() -> bool:
    """An Apple GPU is the default device (MLX's Metal build)."""
    metal = getattr(mx, "metal", None)
    return bool(metal is not None and metal.is_available() and mx.default_device() == mx.gpu)


def use_fast_verify(model: nn.Module) -> list[str]:
    """On a GPU: the one-kernel gated-delta-net verify if `model` has such layers, the CUDA
    kernel or its Metal twin, after a self-check against the reference (a kernel that fails
    to build or to agree leaves the reference, with one warning line). On CUDA also the
    multi-row quantized matmul for the verify pass on the matrices and rows where it is
    measured on first use to win (`routing`; `MTPKIT_QMV=1`: every quantized layer it can take,
    `0`: none). Returns what it installed."""
    if switch("MTPKIT_KERNELS") is False:
        return []
    cuda = cuda_available()
    if cuda:  # the verify pass, and the prefill and plain steps (mlx-lm: ops per token)
        impl, plain, backend = gdn_verify_cuda, gdn_plain_cuda, "CUDA"
    elif metal_available():  # the verify pass only (mlx-lm has its own Metal kernel)
        impl, plain, backend = gdn_verify_metal, gdn_plain_metal, "Metal"
    else:
        return []
    from mtpkit.core.console import warn

    installed = []
    if tap_gated_delta_layers(model):
        try:
            error = self_check(impl, plain)
        except Exception as e:  # a kernel that fails to build leaves the reference in place
            error, detail = float("inf"), f"{type(e).__name__}: {e}".splitlines()[0]
        else:
            detail = f"differs from the reference by {error:.1e}"
        if error <= SELF_CHECK_TOLERANCE:
            set_gdn_verify_impl(impl)
            installed.append("gdn_verify")
            if cuda and switch("MTPKIT_GDN_PLAIN") is not False:
                set_gdn_plain_impl(plain)
                installed.append("gdn_plain")
        else:
            warn(f"the {backend} gated-delta-net verify kernel {detail}; using the reference")
    qmv_choice = switch("MTPKIT_QMV")  # None: measured routes
    if cuda and qmv_choice is not False and _qmv_checked(warn):
        if routing.route_quantized_layers(model, measure=qmv_choice is None):
            installed.append("qmv")
    return installed


_QMV_VERDICT: list[bool] = []


def _qmv_checked(warn: Callable[[str], None]) -> bool:
    """The multi-row matmul's self-check, once per process (a kernel that fails to build or
    to agree leaves MLX's matmul, with one warning line)."""
    if not _QMV_VERDICT:
        try:
            error = qmv.self_check()
        except Exception as e:
            error, detail = float("inf"), f"{type(e).__name__}: {e}".splitlines()[0]
        else:
            detail = f"differs from MLX's by {error:.1e} (relative)"
        ok = error <= qmv.SELF_CHECK_TOLERANCE
        if not ok:
            warn(f"the CUDA multi-row quantized matmul {detail}; using MLX's")
        _QMV_VERDICT.append(ok)
    return _QMV_VERDICT[0]
