"""A quantized matmul for the verify pass's few rows that reads the weights once for all rows.

A verify pass multiplies a few token rows (2-5 for one stream, batch x (depth + 1) for a
batch) by every weight matrix of the backbone. Plain
decoding's single row takes MLX's qmv (a memory-bound kernel that streams the 4-bit weights
once); with more rows MLX's CUDA backend takes a tiled GEMM path meant for many rows, whose
cost grows with the rows. This kernel keeps qmv's shape for up to `MAX_ROWS` rows (its
tensor-core variant: `MMA_MAX_ROWS`): each warp
streams one output feature's packed weights (16 bytes, 32 weights, per lane and step) and
multiplies them with every row held in registers, so the weights cross memory once.

Math (affine 4-bit, group size a multiple of 32, as `mx.quantize` packs it: element j of a
row at bits 4 * (j % 8) of word j // 8; w = scale * q + bias per group):
    out[r, n] = sum over 32-weight chunks c of  scale * sum_c x[r] * q  +  bias * sum_c x[r]
accumulated in float32 and rounded once to x's dtype. It is not bitwise equal to
`mx.quantized_matmul` (whose summation order differs); bench/gpu_kernels.py checks both
against a float32 reference.

Two variants: "fma" (float32 FMAs; any float dtype) and "mma" (bfloat16 rows and scales:
dequantizes to bfloat16 as MLX does and multiplies on the tensor cores, float32 sums), which
the routing prefers where it applies: at 2-5 rows the FMA variant spends about as many
instructions per weight byte as the memory bus delivers bytes, the mma one a fraction.

Used only inside the verify pass, on the matrices and rows where it was measured to win
(`mtpkit.runtime.kernels.routing`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import mlx.core as mx

MAX_ROWS = 5  # the FMA variant's rows (held in registers)
MMA_MAX_ROWS = 16  # the tensor-core variant's: two tiles of the mma's 8
MIN_ROWS = 2
CHUNK = 32  # weights per lane and step: one 16-byte load of 4-bit values
WARP_STEP = 32 * CHUNK  # weights of one row a warp covers per step
WARPS_PER_BLOCK = 8
# Output features per warp (1: most warps in flight; >1: the rows' x values reused).
COLUMNS_PER_WARP = 1

HEADER = """
template <typename T>
__device__ __forceinline__ void mtpkit_load8(const T* p, float* out) {
  if constexpr (sizeof(T) == 2) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = static_cast<float>(h[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = static_cast<float>(p[i]);
    }
  }
}

__device__ __forceinline__ float mtpkit_warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
"""

SOURCE = """
    // x [R, K]; w [N, K / 8] uint32; scales, biases [N, K / GS]; out [R, N].
    const int lane = threadIdx.x;
    const int warp = blockIdx.y * blockDim.y + threadIdx.y;
    const int n0 = warp * C;
    if (n0 >= N) {
      return;
    }
    constexpr int words = K / 8;
    constexpr int groups = K / GS;
    float acc[C][R];
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[c][r] = 0.0f;
      }
    }
    for (int k0 = lane * 32; k0 < K; k0 += 1024) {
      uint4 wq[C];
      float scale[C];
      float bias[C];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const long n = n0 + c;
        wq[c] = *reinterpret_cast<const uint4*>(w + n * words + k0 / 8);
        scale[c] = static_cast<float>(scales[n * groups + k0 / GS]);
        bias[c] = static_cast<float>(biases[n * groups + k0 / GS]);
      }
      float dot[C][R];
      float xsum[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        xsum[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          dot[c][r] = 0.0f;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float xv[8];
          mtpkit_load8(x + static_cast<long>(r) * K + k0 + 8 * j, xv);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            xsum[r] += xv[i];
          }
#pragma unroll
          for (int c = 0; c < C; ++c) {
            const uint32_t word = (j == 0) ? wq[c].x : (j == 1) ? wq[c].y
                                : (j == 2) ? wq[c].z : wq[c].w;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              dot[c][r] += xv[i] * static_cast<float>((word >> (4 * i)) & 0xfu);
            }
          }
        }
      }
#pragma unroll
      for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
          acc[c][r] += scale[c] * dot[c][r] + bias[c] * xsum[r];
        }
      }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float total = mtpkit_warp_sum(acc[c][r]);
        if (lane == 0) {
          out[static_cast<long>(r) * N + n0 + c] = static_cast<OutT>(total);
        }
      }
    }
"""


# The tensor-core variant. A block of SPLIT_K warps computes 16 output features for all
# R <= MMA_MAX_ROWS rows, in tiles of 8 rows (the mma's n) that share the dequantized
# weights: each warp takes every SPLIT_K-th 128-weight segment of K, dequantizes its
# share of the 16 x 128 tile to bfloat16 in registers and multiplies it with the rows by
# `mma.m16n8k16` (bfloat16 in, float32 accumulate); the warps' sums meet in shared memory.
# A dot product does not depend on the order of its terms, so the mma's 16 k positions are
# mapped to the weights a lane already holds: lane (g, t) = (lane / 4, lane % 4) loads 32
# weights (one 16-byte load) of features g and g + 8 at k = seg + 32 t .. + 31; for its word
# j and step u in {0, 1}, the mma's k pairs (2t, 2t+1) and (2t+8, 2t+9) are the nibble pairs
# (2u, 2u+4) and (2u+1, 2u+5) of that word, which one mask extracts together, and the rows'
# x values of the same k are paired to match with a byte permute.
SPLIT_K = 4
SEGMENT = 128

MMA_HEADER = """
#ifndef MTPKIT_EMULATED
__device__ __forceinline__ void mtpkit_mma(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Nibbles p and p + 4 of `w` (two weights), as bfloat16 s * q + b, packed in one register.
__device__ __forceinline__ uint32_t mtpkit_dequant_pair(
    uint32_t w, int p, __nv_bfloat162 s, __nv_bfloat162 b) {
  uint32_t bits = ((w >> (4 * p)) & 0x000F000Fu) | 0x43004300u;  // bfloat16 128 + q
  uint32_t offset_bits = 0x43004300u;                              // bfloat16 128
  __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&bits);
  __nv_bfloat162 offset = *reinterpret_cast<__nv_bfloat162*>(&offset_bits);
  v = __hfma2(__hsub2(v, offset), s, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
"""

MMA_SOURCE = """
    // x [R, K] bfloat16; w [N, K / 8] uint32; scales, biases [N, K / GS] bfloat16; out [R, N].
    // Rows in tiles of 8 (the mma's n): tile i holds rows 8 i .. 8 i + 7.
    constexpr int TILES = (R + 7) / 8;
    const int lane = threadIdx.x;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int split = threadIdx.y;
    const int n0 = blockIdx.y * 16;
    constexpr int words = K / 8;
    constexpr int groups = K / GS;
    const long na = n0 + g;
    const long nb = n0 + g + 8;
    float acc[TILES][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[i][j] = 0.0f;
      }
    }
#pragma unroll 2
    for (int seg = split * SEGMENT; seg < K; seg += SPLIT * SEGMENT) {
      const int kb = seg + 32 * t;
      const uint4 wa = *reinterpret_cast<const uint4*>(w + na * words + kb / 8);
      const uint4 wb = *reinterpret_cast<const uint4*>(w + nb * words + kb / 8);
      const __nv_bfloat162 sa = __bfloat162bfloat162(scales[na * groups + kb / GS]);
      const __nv_bfloat162 ba = __bfloat162bfloat162(biases[na * groups + kb / GS]);
      const __nv_bfloat162 sb = __bfloat162bfloat162(scales[nb * groups + kb / GS]);
      const __nv_bfloat162 bb = __bfloat162bfloat162(biases[nb * groups + kb / GS]);
      uint32_t xw[TILES][16];
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile) {
        const int row = 8 * tile + g;
        if (row < R) {
          const uint4* xp = reinterpret_cast<const uint4*>(x + static_cast<long>(row) * K + kb);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const uint4 v = xp[i];
            xw[tile][4 * i] = v.x;
            xw[tile][4 * i + 1] = v.y;
            xw[tile][4 * i + 2] = v.z;
            xw[tile][4 * i + 3] = v.w;
          }
        } else {
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            xw[tile][i] = 0u;
          }
        }
      }
      const uint32_t wa_words[4] = {wa.x, wa.y, wa.z, wa.w};
      const uint32_t wb_words[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          uint32_t a[4];
          a[0] = mtpkit_dequant_pair(wa_words[j], 2 * u, sa, ba);
          a[1] = mtpkit_dequant_pair(wb_words[j], 2 * u, sb, bb);
          a[2] = mtpkit_dequant_pair(wa_words[j], 2 * u + 1, sa, ba);
          a[3] = mtpkit_dequant_pair(wb_words[j], 2 * u + 1, sb, bb);
#pragma unroll
          for (int tile = 0; tile < TILES; ++tile) {
            uint32_t b[2];
            b[0] = __byte_perm(xw[tile][4 * j + u], xw[tile][4 * j + u + 2], 0x5410);
            b[1] = __byte_perm(xw[tile][4 * j + u], xw[tile][4 * j + u + 2], 0x7632);
            mtpkit_mma(acc[tile], a, b);
          }
        }
      }
    }
    // acc[tile]: features g (acc[0], acc[1]) and g + 8 (acc[2], acc[3]), rows 8 tile + 2t
    // and 8 tile + 2t + 1.
    __shared__ float partial[SPLIT][32][4 * TILES];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        partial[split][lane][4 * tile + i] = acc[tile][i];
      }
    }
    __syncthreads();
    if (split == 0) {
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float total = 0.0f;
#pragma unroll
          for (int s = 0; s < SPLIT; ++s) {
            total += partial[s][lane][4 * tile + i];
          }
          const int r = 8 * tile + 2 * t + (i & 1);
          if (r < R) {
            out[static_cast<long>(r) * N + n0 + g + 8 * (i >> 1)] = static_cast<OutT>(total);
          }
        }
      }
    }
"""


def kernel_shape_ok(*, bits: int, group_size: int, mode: str, n: int, k: int, biased: bool) -> bool:
    """Quantizations and sizes the kernel handles: affine 4-bit with biases, groups of a
    multiple of 32 weights, K a multiple of 32, N a multiple of the columns per warp."""
    return (
        bits == 4
        and mode == "affine"
        and biased
        and group_size % CHUNK == 0
        and k % group_size == 0
        and k % CHUNK == 0
        and n % COLUMNS_PER_WARP == 0
    )


def rows_of(shape: tuple[int, ...]) -> int:
    """How many rows an input of `shape` [..., K] multiplies (its leading dims, flattened)."""
    return math.prod(shape[:-1])


def built_rows(rows: int) -> int:
    """The rows the kernel is built for (one build per count, ~1 s each on an H100): up to
    MAX_ROWS the count itself; past it (the tensor-core variant, a batch's verify) a whole
    tile of 8, the rest zero rows the mma computes anyway. A batch whose rows leave one by
    one then meets two builds, not one per count."""
    return rows if rows <= MAX_ROWS else -(-rows // 8) * 8


def launch_config(rows: int, n: int, columns: int = COLUMNS_PER_WARP) -> dict[str, Any]:
    """Grid and threadgroup of one launch: one warp per `columns` output features."""
    warps = -(-n // columns)
    return {"grid": (32, warps, 1), "threadgroup": (32, min(WARPS_PER_BLOCK, warps), 1)}


def mma_shape_ok(*, rows: int, n: int, k: int, group_size: int, dtypes: tuple) -> bool:
    """What the tensor-core variant takes: up to MMA_MAX_ROWS bfloat16 rows, bfloat16
    scales and biases, 16 | N, K in whole 128-weight segments."""
    return (
        rows <= MMA_MAX_ROWS
        and n % 16 == 0
        and k % SEGMENT == 0
        and group_size % CHUNK == 0
        and all(d == mx.bfloat16 for d in dtypes)
    )


def mma_launch_config(n: int) -> dict[str, Any]:
    """One block of SPLIT_K warps per 16 output features."""
    return {"grid": (32, n // 16 * SPLIT_K, 1), "threadgroup": (32, SPLIT_K, 1)}


@functools.cache
def cuda_qmv_mma_kernel() -> Any:
    """The tensor-core variant's kernel object."""
    return mx.fast.cuda_kernel(
        name="mtpkit_qmv_rows_mma",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=MMA_SOURCE,
        header=MMA_HEADER,
    )


@functools.cache
def cuda_qmv_kernel() -> Any:
    """The CUDA kernel object (built once; MLX compiles one variant per template)."""
    return mx.fast.cuda_kernel(
        name="mtpkit_qmv_rows",
        input_names=["x", "w", "scales", "biases"],
        output_names=["out"],
        source=SOURCE,
        header=HEADER,
    )


def multi_row_qmv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    columns: int = COLUMNS_PER_WARP,
    variant: str = "fma",
) -> mx.array:
    """`mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits=4)` for
    x [..., K] of 2..MAX_ROWS rows (2..MMA_MAX_ROWS with "mma"), on a CUDA GPU: `variant`
    "fma" (float32 FMAs, any float dtype) or "mma" (tensor cores, bfloat16; see
    `mma_shape_ok`)."""
    n, k = w.shape[0], x.shape[-1]
    rows = rows_of(x.shape)
    if variant == "mma":
        built = built_rows(rows)
        flat = x.reshape(rows, k)
        if built > rows:
            flat = mx.pad(flat, [(0, built - rows), (0, 0)])
        (out,) = cuda_qmv_mma_kernel()(
            inputs=[flat, w, scales, biases],
            template=[("R", built), ("K", k), ("N", n), ("GS", group_size), ("OutT", x.dtype),
                      ("SPLIT", SPLIT_K), ("SEGMENT", SEGMENT)],
            output_shapes=[(built, n)],
            output_dtypes=[x.dtype],
            **mma_launch_config(n),
        )  # fmt: skip
        return (out[:rows] if built > rows else out).reshape(*x.shape[:-1], n)
    (out,) = cuda_qmv_kernel()(
        inputs=[x.reshape(rows, k), w, scales, biases],
        template=[("R", rows), ("C", columns), ("K", k), ("N", n), ("GS", group_size),
                  ("OutT", x.dtype)],
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
        **launch_config(rows, n, columns),
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def self_check() -> float:
    """Largest relative difference between the kernel (both variants) and MLX's quantized
    matmul on a small case: 3 rows, 4-bit, bfloat16 and float32."""
    worst = 0.0
    for dtype, variant in ((mx.bfloat16, "mma"), (mx.float32, "fma")):
        n, k, gs = 256, 512, 64
        key_w, key_x = mx.random.split(mx.random.key(1))
        w, scales, biases = mx.quantize(mx.random.normal((n, k), key=key_w).astype(dtype), gs, 4)
        x = mx.random.normal((1, 3, k), key=key_x).astype(dtype)
        if variant == "mma" and not mma_shape_ok(
            rows=3, n=n, k=k, group_size=gs, dtypes=(x.dtype, scales.dtype, biases.dtype)
        ):
            continue
        ours = multi_row_qmv(x, w, scales, biases, group_size=gs, variant=variant)
        ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=gs, bits=4)
        scale = mx.abs(ref).max().item() or 1.0
        worst = max(
            worst, mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32)).max().item() / scale
        )
    return worst


# Relative to the largest output: bfloat16 outputs (8 bits of mantissa) summed in another order.
SELF_CHECK_TOLERANCE = 2e-2
