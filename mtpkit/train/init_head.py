"""The head `mtpkit train-head` starts from: the family's own head class, its decoder block
copied from the backbone's last layer of the same shape, its final norm from the backbone's.

Starting from a trained layer rather than random weights gives the block attention and MLP
weights that already read the backbone's residual stream, which is what NextN heads are
initialised from in practice (DeepSeek-V3 and Qwen3-Next train theirs jointly; EAGLE-style
draft heads copy a layer). The head is float32 while it trains, whatever the backbone's
dtype or quantization: quantized backbone layers are dequantized into it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtpkit.families import BackboneParts, Family
from mtpkit.families.head import MtpHead


def float_parameters(module: nn.Module) -> dict[str, mx.array]:
    """A module's parameters in float32 under their float names: a quantized layer's packed
    `weight`, `scales` and `biases` become its dequantized `weight`."""
    params = dict(tree_flatten(module.parameters()))
    for path, sub in module.named_modules():
        if not isinstance(sub, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            continue
        prefix = f"{path}." if path else ""
        params[f"{prefix}weight"] = mx.dequantize(
            sub.weight,
            sub.scales,
            sub.get("biases"),
            group_size=sub.group_size,
            bits=sub.bits,
            mode=getattr(sub, "mode", "affine"),
        )
        params.pop(f"{prefix}scales", None)
        params.pop(f"{prefix}biases", None)
    return {k: v.astype(mx.float32) for k, v in params.items()}


def _shapes(params: dict[str, mx.array]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in params.items()}


def source_layer(block: nn.Module, layers: list[nn.Module]) -> tuple[int, dict[str, mx.array]]:
    """The last backbone layer whose (dequantized) parameters match `block`'s names and
    shapes, with its parameters; (-1, {}) when none does (e.g. a MoE backbone whose head
    block is dense)."""
    want = _shapes(dict(tree_flatten(block.parameters())))
    for i in range(len(layers) - 1, -1, -1):
        params = float_parameters(layers[i])
        if _shapes(params) == want:
            return i, params
    return -1, {}


def initial_head(
    family: Family, model: nn.Module, parts: BackboneParts, depth_layers: int = 1
) -> tuple[MtpHead, dict[str, Any]]:
    """The family's head for `model` (mlx-lm's, `parts` its backbone parts), in float32,
    and a record of where each part came from (for the manifest).

    - every MTP layer's decoder block: the last backbone layer of the same shape;
    - `fc` over [embedding; hidden]: half of each input ([I/2, I/2]), so the block starts
      from the mean of the two normed inputs rather than from noise;
    - the two input norms: ones; the final norm: the backbone's final norm, since the head's
      output goes through the backbone's lm_head as the last layer's does.
    """
    head = family.build_head(depth_layers, args=family.head_args(model))
    head.set_dtype(mx.float32)
    record: dict[str, Any] = {"block_from_layer": None}
    weights: list[tuple[str, mx.array]] = []
    for i, layer in enumerate(head.layers):
        # The block alone: a DeepSeek-style layer also holds the projection and norms.
        block_names = set(dict(tree_flatten(layer.parameters())))
        index, params = source_layer(layer, parts.layers)
        if index < 0:
            params = _block_only(layer, parts.layers, block_names)
            index = -1 if not params else len(parts.layers) - 1
        weights += [(f"layers.{i}.{k}", v) for k, v in params.items()]
        record["block_from_layer"] = index if index >= 0 else None
    hidden = head.projection(0).weight.shape[0]
    eye = mx.eye(hidden, dtype=mx.float32) * 0.5
    final_norm = float_parameters(parts.final_norm)["weight"]
    for i in range(head.num_steps):
        head.projection(i).weight = mx.concatenate([eye, eye], axis=1)
        head.norm_embedding(i).weight = mx.ones((hidden,), dtype=mx.float32)
        head.norm_hidden(i).weight = mx.ones((hidden,), dtype=mx.float32)
        head.final_norm(i).weight = final_norm
    if weights:
        head.load_weights(weights, strict=False)
    mx.eval(head.parameters())
    return head, record


def _block_only(layer: nn.Module, layers: list[nn.Module], names: set[str]) -> dict[str, mx.array]:
    """For a head layer that carries extra modules (DeepSeek's enorm/hnorm/eh_proj inside
    the layer): the backbone's last layer parameters whose names and shapes it shares."""
    mine = _shapes(dict(tree_flatten(layer.parameters())))
    for i in range(len(layers) - 1, -1, -1):
        params = float_parameters(layers[i])
        shared = {k: v for k, v in params.items() if k in names and mine.get(k) == v.shape}
        if shared and set(params) <= set(mine) and len(shared) == len(params):
            return shared
    return {}
