"""Which tensors to cast and quantize, decided exactly as `mlx_lm.convert` decides.

mlx-lm's rules live on its model classes (`quant_predicate`, `cast_predicate`) and in
`mlx_lm.utils.quantize_model` (a module is quantized when it has `to_quantized` and its input
dimension divides by the group size). Rather than copying those rules, mtpkit builds the
model class for the config (lazily: no weight is ever computed) and asks it, so a change in
mlx-lm's predicates is followed without a change here.
See https://github.com/ml-explore/mlx-lm/blob/main/mlx_lm/utils.py (`quantize_model`).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtpkit.core.choices import AFFINE_GROUP_SIZES, DEFAULT_GROUP_SIZE, MODE_DEFAULTS
from mtpkit.core.errors import MtpkitError
from mtpkit.mlxlm import model_classes


@dataclass(frozen=True)
class QuantSpec:
    """Quantization settings, as mlx-lm records them in `config["quantization"]`."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE
    mode: str = "affine"

    @classmethod
    def for_mode(cls, mode: str, bits: int | None, group_size: int | None) -> QuantSpec:
        """mlx-lm's defaults for what was not given (`defaults_for_mode`)."""
        default_group, default_bits = MODE_DEFAULTS[mode]
        return cls(bits or default_bits, group_size or default_group, mode)

    def as_config(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @classmethod
    def of_params(cls, params: dict[str, Any], default: QuantSpec) -> QuantSpec:
        """What `to_quantized(**params)` builds: keys a predicate leaves out take the
        layer's own defaults (affine; the mode's group size and bits), not the model's."""
        mode = params.get("mode") or "affine"
        group, bits = MODE_DEFAULTS.get(mode, MODE_DEFAULTS["affine"])
        return cls(int(params.get("bits") or bits), int(params.get("group_size") or group), mode)


def mode_problem(mode: str, bits: int | None, group_size: int | None) -> str | None:
    """Why (bits, group_size) do not fit `mode`, or None: the floating-point modes take one pair."""
    if mode == "affine":
        if group_size is not None and group_size not in AFFINE_GROUP_SIZES:
            return f"affine quantization takes group size 32, 64 or 128, not {group_size}"
        return None
    group, fixed_bits = MODE_DEFAULTS[mode]
    if (bits is not None and bits != fixed_bits) or (
        group_size is not None and group_size != group
    ):
        return f"--q-mode {mode} takes {fixed_bits} bits and group size {group} only"
    return None


def build_model(config: dict[str, Any]) -> nn.Module:
    """mlx-lm's model for `config`, built lazily (its random init is never evaluated)."""
    try:
        model_class, args_class = model_classes(config)
        return model_class(args_class.from_dict(copy.deepcopy(config)))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise MtpkitError(
            f"mlx-lm cannot build a {config.get('model_type')} model from this config.json: {e}"
        ) from None


@dataclass
class ModuleTree:
    """The parameter names and shapes of a module tree, and its quantizable modules."""

    params: dict[str, tuple[tuple[int, ...], mx.Dtype]]
    quantizable: dict[str, nn.Module]
    leaves: set[str]

    @classmethod
    def of(cls, module: nn.Module) -> ModuleTree:
        params = {k: (tuple(v.shape), v.dtype) for k, v in tree_flatten(module.parameters())}
        leaves = dict(tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module))
        quantizable = {path: m for path, m in leaves.items() if hasattr(m, "to_quantized")}
        return cls(params, quantizable, set(leaves))


Predicate = Callable[[str, nn.Module], "bool | dict[str, Any]"]
# MLX quantizes an nvfp4 layer of any width its group (16) divides, but its QuantizedLinear and
# QuantizedEmbedding fail at the first call (`[reshape] Cannot reshape array of size 6 into
# shape (1,4)`) unless the width is a multiple of 32 (MLX 0.32).
NVFP4_WIDTH = 32


def quant_decision(
    path: str, tree: ModuleTree, spec: QuantSpec, predicate: Predicate | None
) -> tuple[QuantSpec | None, dict[str, Any] | None]:
    """(settings or None, the params mlx-lm records for this path or None) for module `path`.

    Mirrors `wrapped_predicate` in mlx_lm.utils.quantize_model: modules without
    `to_quantized` or whose input dimension the group size does not divide stay as they are;
    the predicate may veto or override (e.g. routers at 8 bits, group 64), and its dict is
    recorded as it is (a mixed recipe's `group_size` may be null).
    """
    module = tree.quantizable.get(path)
    if module is None:
        return None, None
    if module.weight.shape[-1] % spec.group_size != 0:
        return None, None
    verdict: bool | dict[str, Any] = True if predicate is None else predicate(path, module)
    if verdict is False:
        return None, None
    chosen, recorded = (
        (QuantSpec.of_params(verdict, spec), dict(verdict))
        if isinstance(verdict, dict)
        else (spec, None)
    )
    width = module.weight.shape[-1]
    if chosen.mode == "nvfp4" and width % NVFP4_WIDTH:
        raise MtpkitError(
            f"--q-mode nvfp4 cannot quantize {path} (input width {width}): MLX runs nvfp4 "
            f"layers only on widths that are multiples of {NVFP4_WIDTH}, so nothing could run "
            "the result; use --q-mode mxfp4 or -q (affine), which leave such layers unquantized"
        )
    return chosen, recorded


def mixed_predicate(recipe: str, model: nn.Module, group_size: int | None) -> Predicate:
    """mlx_lm.convert's own `--quant-predicate` recipe for `model` (imported, not copied:
    a change upstream is followed). It replaces the model's predicate, as in mlx-lm."""
    from mlx_lm.convert import mixed_quant_predicate_builder

    try:
        return mixed_quant_predicate_builder(recipe, model, group_size)
    except ValueError as e:
        raise MtpkitError(f"--quant-predicate {recipe}: {e}") from None


def head_predicate(predicate: Predicate, model: nn.Module, head_prefix: str) -> Predicate:
    """`predicate` for the MTP head, whose layers sit after the backbone's last: each head
    path is asked as the path of backbone layer `num_layers + i` (a mixed recipe's rule for
    that layer type and depth), root modules (fc, norms) as layer `num_layers`."""
    layer_path = next((k for k, _ in model.named_modules() if "down_proj" in k), None)
    parts = (layer_path or "model.layers.0").split(".")
    at = next((i for i, p in enumerate(parts) if p.isdigit()), len(parts) - 1)
    layers = ".".join(parts[:at])
    count = len(model.layers)

    def ask(path: str, module: nn.Module) -> bool | dict[str, Any]:
        rest = path.removeprefix(head_prefix)
        first, _, tail = rest.partition(".")
        index, _, after = tail.partition(".")
        if first == "layers" and index.isdigit() and after:
            return predicate(f"{layers}.{count + int(index)}.{after}", module)
        return predicate(f"{layers}.{count}.{rest}", module)

    return ask


def model_quant_predicate(model: nn.Module) -> Predicate | None:
    return getattr(model, "quant_predicate", None)


def model_cast_predicate(model: nn.Module) -> Callable[[str], bool]:
    return getattr(model, "cast_predicate", lambda _: True)


def quantize(array: mx.array, spec: QuantSpec) -> dict[str, mx.array]:
    """What `to_quantized` of Linear/SwitchLinear/Embedding computes: `weight`, `scales`
    and (affine only) `biases`."""
    packed = mx.quantize(array, group_size=spec.group_size, bits=spec.bits, mode=spec.mode)
    return dict(zip(("weight", "scales", "biases"), packed, strict=False))


def infer_spec(
    weight_shape: tuple[int, ...],
    scales_shape: tuple[int, ...],
    in_dims: int,
    scales_dtype: mx.Dtype | None = None,
) -> QuantSpec:
    """The settings a stored quantized weight was packed with.

    The arithmetic of `mlx_lm.utils.infer_quant_config` (only affine keeps its scales in a
    float dtype; each floating-point mode has one (bits, group size) pair); not imported
    from there because `mlx_lm.utils` loads transformers (about 0.9 s and 50 MB per
    conversion, a third of a 1 GB conversion's time) and conversion never needs it.
    """
    bits, group = (weight_shape[-1] * 32) // in_dims, in_dims // scales_shape[-1]
    mode = "affine"
    if scales_dtype == mx.uint8:
        by_pair = {(b, g): m for m, (g, b) in MODE_DEFAULTS.items() if m != "affine"}
        if (bits, group) not in by_pair:
            raise MtpkitError(f"cannot tell the quantization mode of {bits} bits, group {group}")
        mode = by_pair[(bits, group)]
    return QuantSpec(bits=bits, group_size=group, mode=mode)


def is_floating(dtype: mx.Dtype) -> bool:
    return mx.issubdtype(dtype, mx.floating)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def count_parameters(name: str, shape: tuple[int, ...], size: int, tree: ModuleTree | None) -> int:
    """Parameters of one tensor as mlx-lm's get_total_parameters counts them: those of leaf
    modules only (not e.g. a gated delta net's own A_log), packed weights unpacked."""
    module, _, leaf = name.rpartition(".")
    if tree is None:
        return size
    if module not in tree.leaves:
        return 0
    if leaf in ("scales", "biases") and module in tree.quantizable:
        return 0
    if leaf == "weight" and module in tree.quantizable:
        expected = tree.params.get(name)
        if expected is not None and shape != expected[0]:
            return math.prod(expected[0])
    return size


def quantization_paths(
    tree: ModuleTree, written: dict[str, mx.array]
) -> dict[str, bool | dict[str, Any]]:
    """Every quantizable module path -> False or the settings its written weight was packed
    with, as `config["quantization"]` records per path."""
    paths: dict[str, bool | dict[str, Any]] = {}
    for path, module in sorted(tree.quantizable.items()):
        scales = written.get(f"{path}.scales")
        if scales is None:
            paths[path] = False
            continue
        weight = written[f"{path}.weight"]
        in_dims = module.weight.shape[-1]
        spec = infer_spec(tuple(weight.shape), tuple(scales.shape), in_dims, scales.dtype)
        paths[path] = spec.as_config()
    return paths


# --------------------------------------------------------------------------- CPU note

# MLX's CPU backend runs a quantized matmul with bfloat16 or float16 scales on a slow path,
# while dense bfloat16 matmuls run as fast as float32 ones. Measured with MLX 0.32.4 on this
# project's x86-64 Linux CPU, one row times a 4-bit 128x1024 matrix: 0.6 ms with float32
# scales, 5.4 ms with bfloat16, 16 ms with float16 (1024x4096: 11 ms vs 113 ms in bfloat16);
# `mtpkit check` of the example's 4-bit conversion took 52.8 s against 16.7 s.
SLOW_CPU_SCALES = {"BF16": "bfloat16", "F16": "float16"}


def scales_dtype(model_dir: Path) -> str | None:
    """The safetensors dtype of the first quantized layer's scales in `model_dir`, if any."""
    from mtpkit.checkpoint.headers import parse_header

    for shard in sorted(model_dir.glob("*.safetensors")):
        with open(shard, "rb") as f:

            def read(start: int, length: int) -> bytes:
                f.seek(start)
                return f.read(length)

            header = parse_header(shard.name, shard.stat().st_size, read)
        for name, info in header.tensors.items():
            if name.endswith(".scales"):
                return info.dtype
    return None


def cpu_scales_note(model_dir: Path) -> str | None:
    """A `note:` line when this machine runs MLX on its CPU (Linux without a GPU backend)
    and the quantized layers in `model_dir` have bfloat16 or float16 scales."""
    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu:
        return None
    dtype = SLOW_CPU_SCALES.get(scales_dtype(model_dir) or "")
    if dtype is None:
        return None
    return (
        f"note: the quantized layers have {dtype} scales, which MLX's CPU backend (this "
        "machine's) multiplies up to 10x slower than float32 ones; to run the model here, "
        "convert with --dtype float32 (Apple silicon and GPUs run it as it is)"
    )
