"""Compile `mx.fast.cuda_kernel` bodies with nvcc, without a GPU.

MLX's CUDA backend wraps a kernel body into `__global__ void name(const T* in, ...,
T* out)` with the template arguments as `constexpr int` / `using` lines at the top
(mlx/backend/cuda/custom_kernel.cpp, `build_kernel`) and JIT-compiles it on first use. This
writes the same wrapper so a CPU machine with the CUDA toolkit can catch compile errors.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half",
              "uint32": "uint32_t", "bool": "bool"}  # fmt: skip

PRELUDE = """
#include <cstdint>
#include <cuda/std/array>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#define MAX_NDIM 8
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
"""


def nvcc() -> str | None:
    return shutil.which("nvcc")


def wrap(
    name: str,
    body: str,
    header: str,
    inputs: list[tuple[str, str]],
    outputs: list[tuple[str, str]],
    template: list[tuple[str, int | str]],
) -> str:
    """One kernel as MLX would generate it: inputs and outputs are (name, dtype name);
    template values are ints or dtype names. An input whose `NAME_shape` the body reads is
    followed by that parameter, as MLX adds it (`Shape`: MAX_NDIM int32 values)."""
    params = []
    for n, t in inputs:
        params.append(f"    const {CUDA_TYPES[t]}* {n}")
        if f"{n}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {n}_shape")
    params += [f"    {CUDA_TYPES[t]}* {n}" for n, t in outputs]
    consts = [
        f"  using {n} = {CUDA_TYPES[v]};" if isinstance(v, str) else f"  constexpr int {n} = {v};"
        for n, v in template
    ]
    return (
        f"namespace mtpkit_test_{name} {{\n{header}\n__global__ void {name}(\n"
        + ",\n".join(params)
        + ") {\n"
        + "\n".join(consts)
        + f"\n{body}\n}}\n}}\n"
    )


def compile_units(units: list[str], workdir: Path, arch: str = "sm_90") -> None:
    """Compile the kernels (each in its own namespace, with its header) to PTX; raise
    with nvcc's message on an error."""
    source = PRELUDE + "".join(units)
    path = workdir / "kernels.cu"
    path.write_text(source)
    result = subprocess.run(
        [nvcc(), "-std=c++17", f"-arch={arch}", "--ptx", str(path), "-o", str(workdir / "k.ptx")],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise AssertionError(result.stderr[-4000:])
