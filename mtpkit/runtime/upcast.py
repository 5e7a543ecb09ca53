"""MoE experts in float32 where MLX cannot run them in half precision (its CPU backend).

MLX's CPU `GatherMM` (what mlx-lm's `SwitchLinear` calls) supports float32 only, so a bf16 or
fp16 MoE model fails on a Linux runner with `[GatherMM::eval] Currently only supports
float32`. There, and only there, the unquantized `SwitchLinear` layers of a loaded model are
upcast once at load: their weights become float32 and each call casts its input to float32
and its output back to the caller's dtype, so every other layer runs as published. Quantized
experts (`gather_qmm`) run in any dtype and are left alone. The extra memory is estimated
first; what does not fit is `ExpertsTooLarge` (problem `moe_float32_exceeds_memory`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError

HALF_DTYPES = (mx.bfloat16, mx.float16)
# What the rest of the machine keeps: the upcast may take this share of available memory.
MEMORY_SHARE = 0.8


class ExpertsTooLarge(MtpkitError):
    """The float32 copy of the MoE experts would not fit in available memory."""

    code = "moe_float32_exceeds_memory"


def needs_float32_experts() -> bool:
    """Whether MLX computes on its CPU backend here (no half-precision GatherMM)."""
    return mx.default_device().type == mx.DeviceType.cpu


def available_memory() -> int:
    """Bytes the system can still give this process (`MemAvailable`, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def half_experts(model: nn.Module) -> list[nn.Module]:
    """The unquantized SwitchLinear layers of `model` stored in bf16/fp16."""
    from mlx_lm.models.switch_layers import SwitchLinear

    return [
        m
        for _, m in model.named_modules()
        if isinstance(m, SwitchLinear) and m.weight.dtype in HALF_DTYPES
    ]


def extra_bytes(layers: Iterable[nn.Module]) -> int:
    """What the float32 copies add: 4 bytes per parameter instead of the stored 2."""
    total = 0
    for layer in layers:
        for _, p in nn.utils.tree_flatten(layer.parameters()):
            total += p.size * (4 - p.itemsize)
    return total


def moe_dtype(model: nn.Module) -> str | None:
    """What the MoE experts compute in: `float32`, `bfloat16`, `4-bit` for quantized ones,
    or several joined by ", " (mlx-lm leaves experts whose width the group size does not
    divide unquantized); None without MoE layers."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    kinds = set()
    for _, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear):
            kinds.add(f"{m.bits}-bit")
        elif isinstance(m, SwitchLinear):
            kinds.add(_name(m.weight))
    return ", ".join(sorted(kinds)) or None


def _name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def _float32_class(base: type) -> type:
    if getattr(base, "_mtpkit_float32", False):
        return base

    def __call__(self: nn.Module, x: mx.array, *args: object, **kwargs: object) -> mx.array:
        return base.__call__(self, x.astype(mx.float32), *args, **kwargs)

    return type(f"Float32{base.__name__}", (base,), {"__call__": __call__, "_mtpkit_float32": True})


def upcast_experts(models: Iterable[nn.Module | None], *, what: str = "the model") -> int:
    """Upcast the half-precision experts of `models` (backbone, head) to float32 on CPU.

    Returns the bytes added. Raises ExpertsTooLarge, touching nothing, when that exceeds
    the share of available memory this process may take. A no-op off the CPU backend.
    """
    if not needs_float32_experts():
        return 0
    layers = [layer for m in models if m is not None for layer in half_experts(m)]
    if not layers:
        return 0
    extra, available = extra_bytes(layers), available_memory()
    if extra > MEMORY_SHARE * available:
        raise ExpertsTooLarge(
            f"{ExpertsTooLarge.code}: MLX's CPU backend runs MoE experts in float32 only, and "
            f"upcasting those of {what} needs {extra / 2**30:.2f} GiB more than the "
            f"{available / 2**30:.2f} GiB available: run on Apple silicon (Metal), free memory, "
            "or use a quantized conversion (`mtpkit convert --bits 4`)"
        )
    for layer in layers:
        for name, p in nn.utils.tree_flatten(layer.parameters()):
            layer.update(nn.utils.tree_unflatten([(name, p.astype(mx.float32))]))
        layer.__class__ = _float32_class(type(layer))
        mx.eval(layer.parameters())  # one layer at a time: the bf16 copy is freed as we go
    return extra
