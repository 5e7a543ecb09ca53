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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtpkit.core.choices import DEFAULT_GROUP_SIZE
from mtpkit.core.errors import MtpkitError
from mtpkit.mlxlm import model_classes


@dataclass(frozen=True)
class QuantSpec:
    """Affine quantization settings, as mlx-lm records them in `config["quantization"]`."""

    bits: int
    group_size: int = DEFAULT_GROUP_SIZE

    def as_config(self) -> dict[str, int]:
        return {"group_size": self.group_size, "bits": self.bits}


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


def quant_decision(
    path: str, tree: ModuleTree, spec: QuantSpec, predicate: Predicate | None
) -> tuple[QuantSpec | None, bool]:
    """(settings or None, whether mlx-lm would record them per path) for module `path`.

    Mirrors `wrapped_predicate` in mlx_lm.utils.quantize_model: modules without
    `to_quantized` or whose input dimension the group size does not divide stay as they are;
    the model's predicate may veto or override (e.g. routers at 8 bits, group 64).
    """
    module = tree.quantizable.get(path)
    if module is None:
        return None, False
    if module.weight.shape[-1] % spec.group_size != 0:
        return None, False
    verdict: bool | dict[str, Any] = True if predicate is None else predicate(path, module)
    if verdict is False:
        return None, False
    if isinstance(verdict, dict):
        override = QuantSpec(
            bits=int(verdict.get("bits", spec.bits)),
            group_size=int(verdict.get("group_size", spec.group_size)),
        )
        return override, True
    return spec, False


def model_quant_predicate(model: nn.Module) -> Predicate | None:
    return getattr(model, "quant_predicate", None)


def model_cast_predicate(model: nn.Module) -> Callable[[str], bool]:
    return getattr(model, "cast_predicate", lambda _: True)


def quantize(array: mx.array, spec: QuantSpec) -> tuple[mx.array, mx.array, mx.array]:
    """Affine quantization, what `to_quantized` of Linear/SwitchLinear/Embedding computes."""
    weight, scales, biases = mx.quantize(array, group_size=spec.group_size, bits=spec.bits)
    return weight, scales, biases


def infer_spec(
    weight_shape: tuple[int, ...], scales_shape: tuple[int, ...], in_dims: int
) -> QuantSpec:
    """The settings a stored quantized weight was packed with.

    The arithmetic of `mlx_lm.utils.infer_quant_config`, for the affine mode mtpkit writes;
    not imported from there because `mlx_lm.utils` loads transformers (about 0.9 s and 50 MB
    per conversion, a third of a 1 GB conversion's time) and conversion never needs it.
    """
    return QuantSpec(
        bits=(weight_shape[-1] * 32) // in_dims, group_size=in_dims // scales_shape[-1]
    )


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
) -> dict[str, bool | dict[str, int]]:
    """Every quantizable module path -> False or the settings its written weight was packed
    with, as `config["quantization"]` records per path."""
    paths: dict[str, bool | dict[str, int]] = {}
    for path, module in sorted(tree.quantizable.items()):
        scales = written.get(f"{path}.scales")
        if scales is None:
            paths[path] = False
            continue
        weight = written[f"{path}.weight"]
        in_dims = module.weight.shape[-1]
        paths[path] = infer_spec(tuple(weight.shape), tuple(scales.shape), in_dims).as_config()
    return paths
