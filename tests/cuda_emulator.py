"""Run `mx.fast.cuda_kernel` (and `metal_kernel`) sources on the CPU: the very kernel text,
compiled as C++.

Each kernel body is wrapped the way MLX's CUDA backend wraps it (`tests.cuda_source.wrap`)
and compiled with g++ against a small stand-in for the CUDA built-ins it uses: `threadIdx`,
`blockIdx`, `blockDim` (thread-local), `uint4`, `__nv_bfloat16` (round to nearest even), and
`__shfl_xor_sync` (the 32 lanes of a warp are 32 threads meeting at a barrier). A launch
runs the blocks of MLX's grid arithmetic (grid in threads, block = min(threadgroup, grid))
one warp at a time. Slow, and only for the kernels' logic (indexing, reductions, casts):
their speed is measured on a GPU by bench/gpu_kernels.py.

Metal sources get Metal's names for the same built-ins (`EmulatedMetalKernel`).
`EmulatedKernel` takes `mx.fast.cuda_kernel`'s arguments and returns MLX arrays, so the
production wrappers (`kernels._launch`, `qmv.multi_row_qmv`) run unchanged around it.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tests.cuda_source import wrap

PRELUDE = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#define __grid_constant__
using Shape = std::array<int32_t, 8>;  // MLX's MAX_NDIM
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim;
struct uint4 { uint32_t x, y, z, w; };
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = static_cast<uint16_t>(u >> 16);
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
#define __device__
#define __forceinline__ inline
#define __global__

#define __shared__ static  // blocks run one after another: one copy serves each in turn
#define MTPKIT_EMULATED

struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 v) { return {v, v}; }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {__nv_bfloat16(float(a.x) - float(b.x)), __nv_bfloat16(float(a.y) - float(b.y))};
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return {__nv_bfloat16(std::fma(float(a.x), float(b.x), float(c.x))),
          __nv_bfloat16(std::fma(float(a.y), float(b.y), float(c.y)))};
}
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= static_cast<uint32_t>((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}

struct WarpState {
  std::barrier<> bar{32};
  float vals[32];
  uint32_t a[32][4], b[32][2];
};
thread_local WarpState* mtpkit_warp = nullptr;
thread_local std::barrier<>* mtpkit_block = nullptr;
inline void __syncthreads() { mtpkit_block->arrive_and_wait(); }

inline float mtpkit_half_of(uint32_t v, int high) {
  __nv_bfloat16 h;
  h.bits = static_cast<uint16_t>(high ? v >> 16 : v & 0xffffu);
  return float(h);
}
// mma.m16n8k16 (bfloat16, float32 accumulate) from the PTX ISA's fragment layouts.
inline void mtpkit_mma(float* d, const uint32_t* a, const uint32_t* b) {
  const unsigned lane = threadIdx.x;
  WarpState* w = mtpkit_warp;
  for (int i = 0; i < 4; ++i) w->a[lane][i] = a[i];
  for (int i = 0; i < 2; ++i) w->b[lane][i] = b[i];
  w->bar.arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int m = g + 8 * (i >> 1), n = 2 * t + (i & 1);
    float sum = d[i];
    for (int k = 0; k < 16; ++k) {
      const float av = mtpkit_half_of(w->a[(m % 8) * 4 + (k % 8) / 2][(m >= 8) + 2 * (k >= 8)], k % 2);
      const float bv = mtpkit_half_of(w->b[n * 4 + (k % 8) / 2][k >= 8], k % 2);
      sum += av * bv;
    }
    d[i] = sum;
  }
  w->bar.arrive_and_wait();
}
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const unsigned lane = threadIdx.x;
  mtpkit_warp->vals[lane] = v;
  mtpkit_warp->bar.arrive_and_wait();
  const float r = mtpkit_warp->vals[lane ^ offset];
  mtpkit_warp->bar.arrive_and_wait();
  return r;
}
"""

# Metal's names for the same things (a SIMD group is a warp of 32 lanes).
METAL_PRELUDE = r"""
struct UInt3 { unsigned x = 0, y = 0, z = 0; };
thread_local UInt3 thread_position_in_grid, thread_position_in_threadgroup;
thread_local unsigned thread_index_in_simdgroup;
inline float simd_sum(float v) {
  const unsigned lane = threadIdx.x;
  mtpkit_warp->vals[lane] = v;
  mtpkit_warp->bar.arrive_and_wait();
  float total = 0.0f;
  for (int i = 0; i < 32; ++i) total += mtpkit_warp->vals[i];
  mtpkit_warp->bar.arrive_and_wait();
  return total;
}
#define device
"""

LAUNCHER = r"""
extern "C" void launch(void** bufs, int gx, int gy, int gz, int tx, int ty, int tz) {
  const Dim3 block{unsigned(std::min(tx, gx)), unsigned(std::min(ty, gy)),
                   unsigned(std::min(tz, gz))};
  const Dim3 grid{unsigned((gx + tx - 1) / tx), unsigned((gy + ty - 1) / ty),
                  unsigned((gz + tz - 1) / tz)};
  blockDim = block;
  for (unsigned bz = 0; bz < grid.z; ++bz)
  for (unsigned by = 0; by < grid.y; ++by)
  for (unsigned bx = 0; bx < grid.x; ++bx) {
    // All threads of a block at once (for __syncthreads); a warp is 32 lanes along x.
    // Metal launches exactly `grid` threads (a last, partial threadgroup); CUDA whole blocks.
    std::vector<std::pair<unsigned, unsigned>> warps;
    for (unsigned z = 0; z < block.z; ++z)
      for (unsigned y = 0; y < block.y; ++y)
        if (!METAL || (by * block.y + y < unsigned(gy) && bz * block.z + z < unsigned(gz)))
          warps.emplace_back(y, z);
    std::vector<WarpState> states(warps.size());
    std::barrier<> block_barrier(static_cast<std::ptrdiff_t>(32 * warps.size()));
    std::vector<std::thread> threads;
    for (size_t wi = 0; wi < warps.size(); ++wi) {
      const unsigned y = warps[wi].first, z = warps[wi].second;
      for (unsigned lane = 0; lane < 32; ++lane) {
        threads.emplace_back([&, wi, y, z, lane] {
          threadIdx = Dim3{lane, y, z};
          blockIdx = Dim3{bx, by, bz};
          mtpkit_warp = &states[wi];
          mtpkit_block = &block_barrier;
          SET_METAL_POSITION;
          KERNEL_CALL;
        });
      }
    }
    for (auto& t : threads) t.join();
  }
}
"""

NUMPY = {mx.float32: np.float32, mx.bfloat16: np.uint16, mx.uint32: np.uint32, mx.bool_: np.bool_}
NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.uint32: "uint32", mx.bool_: "bool"}
CPP_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "uint32": "uint32_t",
             "bool": "bool"}  # fmt: skip


@functools.cache
def _workdir() -> Path:
    """A temporary directory for the compiled kernels, removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="mtpkit-cuda-emulator-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def gxx() -> str | None:
    return shutil.which("g++")


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def _to_mlx(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class EmulatedKernel:
    """`mx.fast.cuda_kernel(name, input_names, output_names, source, header)`, on the CPU."""

    _built: dict[str, ctypes.CDLL] = {}
    metal = False

    def __init__(self, *, name, input_names, output_names, source, header="", **_: Any):
        self.name, self.inputs, self.outputs = name, input_names, output_names
        self.source, self.header = source, header

    def _library(self, inputs, output_dtypes, template) -> ctypes.CDLL:
        template = [(n, NAMES[v] if isinstance(v, mx.Dtype) else int(v)) for n, v in template]
        ins = [(n, NAMES[a.dtype]) for n, a in zip(self.inputs, inputs, strict=True)]
        outs = [(n, NAMES[d]) for n, d in zip(self.outputs, output_dtypes, strict=True)]
        unit = wrap(self.name, self.source, self.header, ins, outs, template)
        args = []  # each input's buffer, then its shape where the body reads it; the outputs
        for n, t in ins:
            args.append(f"(const {CPP_TYPES[t]}*)bufs[{len(args)}]")
            if f"{n}_shape" in self.source:
                args.append(f"*(const Shape*)bufs[{len(args)}]")
        args += [f"({CPP_TYPES[t]}*)bufs[{len(args) + i}]" for i, (_, t) in enumerate(outs)]
        call = f"mtpkit_test_{self.name}::{self.name}({', '.join(args)})"
        position = (
            "thread_position_in_grid = UInt3{bx * block.x + lane, by * block.y + y, "
            "bz * block.z + z}; thread_position_in_threadgroup = UInt3{lane, y, z}; "
            "thread_index_in_simdgroup = lane"
            if self.metal else "(void)0"
        )  # fmt: skip
        launcher = LAUNCHER.replace("KERNEL_CALL", call).replace("SET_METAL_POSITION", position)
        prelude = PRELUDE + f"constexpr bool METAL = {'true' if self.metal else 'false'};\n"
        text = prelude + (METAL_PRELUDE if self.metal else "") + unit + launcher
        key = hashlib.sha1(text.encode()).hexdigest()[:16]
        if key not in self._built:
            src, lib = _workdir() / f"{key}.cpp", _workdir() / f"{key}.so"
            src.write_text(text)
            result = subprocess.run(
                [gxx(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", str(src),
                 "-o", str(lib)], capture_output=True, text=True,
            )  # fmt: skip
            if result.returncode != 0:
                raise AssertionError(result.stderr[-4000:])
            self._built[key] = ctypes.CDLL(str(lib))
        return self._built[key]

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
                 **_: Any) -> list[mx.array]:  # fmt: skip
        inputs = [mx.contiguous(a) for a in inputs]
        library = self._library(inputs, output_dtypes, template)
        host_in = []
        for name, a in zip(self.inputs, inputs, strict=True):
            host_in.append(_to_numpy(a))
            if f"{name}_shape" in self.source:  # MLX passes it by value: MAX_NDIM int32s
                host_in.append(np.array(list(a.shape) + [0] * (8 - a.ndim), np.int32))
        host_out = [np.zeros(tuple(s), NUMPY[d]) for s, d in zip(output_shapes, output_dtypes,
                                                                 strict=True)]  # fmt: skip
        buffers = (ctypes.c_void_p * (len(host_in) + len(host_out)))(
            *[a.ctypes.data for a in host_in + host_out]
        )
        library.launch(buffers, *map(ctypes.c_int, (*grid, *threadgroup)))
        return [_to_mlx(a, d) for a, d in zip(host_out, output_dtypes, strict=True)]


class EmulatedMetalKernel(EmulatedKernel):
    """`mx.fast.metal_kernel(...)` likewise: `thread_position_in_grid` and friends, and
    `simd_sum` over the 32 lanes of a SIMD group."""

    metal = True
