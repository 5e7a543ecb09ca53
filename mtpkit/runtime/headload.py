"""Loading an MTP head at run time: find its tensors in a model directory, build the
family's head, load them strictly.

The layouts in the wild: a sidecar file (`mtp/weights.safetensors`, vllm-mlx's
`model-mtp.safetensors`, ...), the head inline in the model shards (community "-MTP"
builds), or a raw Hugging Face checkpoint. Everything family-specific (where the head may
sit, how raw layers are named, which norms are zero-centred, the head class) is asked of
the family (`mtpkit.families`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.convert.rules import shift_norm, stack_experts
from mtpkit.core.config import load_json
from mtpkit.core.errors import MtpkitError
from mtpkit.families import Family, family_for, supported
from mtpkit.families.head import CONCAT_ORDERS, EMBEDDING_FIRST, HIDDEN_FIRST, MtpHead

__all__ = [
    "CONCAT_ORDERS",
    "EMBEDDING_FIRST",
    "HIDDEN_FIRST",
    "SIDECAR_FILES",
    "HeadWeights",
    "MtpHead",
    "build_head",
    "load_head",
    "read_head_weights",
    "shift_norms",
    "stack_experts",
    "supported_families",
]

SIDECAR_FILES = ("mtp/weights.safetensors", "mtp.safetensors", "model-mtp.safetensors")


@dataclass
class HeadWeights:
    """Head tensors under head-relative names, and what was done to them on the way in."""

    weights: dict[str, mx.array]
    layout: str  # "sidecar", "inline" or "raw_hf"
    prefix: str
    files: list[str]
    manifest: dict[str, Any] | None = None
    transforms: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        layers = {int(m.group(1)) for k in self.weights if (m := re.match(r"layers\.(\d+)\.", k))}
        return max(layers) + 1 if layers else 0


def supported_families() -> list[str]:
    return supported()


def build_head(
    config: dict[str, Any], num_layers: int = 1, weight_names: Iterable[str] = ()
) -> MtpHead:
    """The config's family head, randomly initialised (load weights next)."""
    return family_for(config).build_head(num_layers, weight_names)


def shift_norms(weights: dict[str, mx.array], family: Family) -> dict[str, mx.array]:
    """The family's zero-centred head norms (the model applies 1 + w) to mlx gammas,
    shifted in float32; every other tensor passes through."""
    out = {}
    for k, v in weights.items():
        if v.ndim == 1 and family.shifts_head_norm(k):
            out[k] = shift_norm(v)
        else:
            out[k] = v
    return out


def _first_prefix(names: list[str], prefixes: tuple[str, ...]) -> str | None:
    for p in prefixes:
        if any(n.startswith(p) for n in names):
            return p
    return None


def _prefixes(family: Family, manifest: dict[str, Any] | None) -> tuple[str, ...]:
    """Where the head may sit, the manifest's `prefix` first."""
    first = (str(manifest["prefix"]),) if manifest and manifest.get("prefix") else ()
    return first + tuple(p for p in family.head_prefixes if p not in first)


def _read_sidecar(
    model_dir: Path, rel: str, family: Family, manifest: dict[str, Any] | None
) -> HeadWeights:
    tensors = mx.load(str(model_dir / rel))
    prefix = _first_prefix(list(tensors), _prefixes(family, manifest)) or ""
    weights = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    hw = HeadWeights(weights, "sidecar", prefix, [rel], manifest)
    if manifest and manifest.get("rmsnorm_weight_format") == "zero_centred":
        hw.weights = shift_norms(hw.weights, family)
        hw.transforms.append("shifted zero-centred norms by +1 (manifest)")
    hw.weights = stack_experts(hw.weights, family.expert_projections)
    return hw


def _read_shards(
    model_dir: Path, config: dict[str, Any], family: Family, manifest: dict[str, Any] | None
) -> HeadWeights | None:
    """The head inline in the model shards (community "-MTP" builds) or in a raw checkpoint."""
    head: dict[str, mx.array] = {}
    files: list[str] = []
    raw = "quantization" not in config and "quantization_config" not in config
    conv_raw = False
    prefix = None
    for shard in sorted(p.name for p in model_dir.glob("model*.safetensors")):
        tensors = mx.load(str(model_dir / shard))
        if any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in tensors.items()):
            conv_raw = True  # mlx-lm's own test for an unconverted Qwen3.5/Next checkpoint
        found = False
        if (p := _first_prefix(list(tensors), _prefixes(family, manifest))) is not None:
            prefix = p
            for k, v in tensors.items():
                if k.startswith(p):
                    head[k[len(p) :]] = v
                    found = True
        elif raw_names := family.raw_head_tensors(tensors):
            head.update({rel: tensors[name] for name, rel in raw_names.items()})
            prefix = family.raw_head_label()
            found = True
        if found:
            files.append(shard)
    if not head:
        return None
    # A raw HF checkpoint keeps zero-centred norms; converted (inline) ones are shifted.
    zero_centred = family.zero_centred_norms and (conv_raw or (raw and prefix == "mtp."))
    layout = "raw_hf" if zero_centred or (prefix or "").startswith("model.") else "inline"
    hw = HeadWeights(head, layout, prefix or "", files, manifest)
    if zero_centred:
        hw.weights = shift_norms(hw.weights, family)
        hw.transforms.append("shifted zero-centred norms by +1 (raw checkpoint)")
    hw.weights = stack_experts(hw.weights, family.expert_projections)
    return hw


def read_head_weights(model_dir: Path, config: dict[str, Any]) -> HeadWeights | None:
    """The head's tensors from a sidecar, the model shards (inline) or a raw HF checkpoint.

    Returns None when the directory holds no MTP tensors.
    """
    family = family_for(config)
    manifest_path = model_dir / "mtp" / "manifest.json"
    manifest = (
        load_json(manifest_path.read_text(), str(manifest_path)) if manifest_path.exists() else None
    )
    for rel in SIDECAR_FILES:
        if (model_dir / rel).exists():
            return _read_sidecar(model_dir, rel, family, manifest)
    return _read_shards(model_dir, config, family, manifest)


def quantization_predicate(
    weights: dict[str, mx.array], qconfig: dict[str, Any], prefix: str
) -> Callable[[str, nn.Module], bool | dict[str, Any]]:
    """Quantize exactly the layers whose weights carry scales, with bits and group size
    read from the shapes (what the tensors are), falling back on the config's entry."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        entry = qconfig.get(f"{prefix}{path}")
        params: dict[str, Any] = {}
        if isinstance(entry, dict):
            params.update({k: entry[k] for k in ("bits", "group_size", "mode") if entry.get(k)})
            # A per-path entry is what mlx-lm passes to `to_quantized`: no mode means affine.
            params.setdefault("mode", "affine")
        in_dims = module.weight.shape[-1]
        packed = weights[f"{path}.weight"].shape[-1]
        params.setdefault("group_size", in_dims // scales.shape[-1])
        params.setdefault("bits", packed * 32 // in_dims)
        params.setdefault("mode", qconfig.get("mode") or "affine")
        return params

    return predicate


def load_head(
    model_dir: Path,
    config: dict[str, Any],
    *,
    norm_shift: float = 0.0,
    concat_order: str | None = None,
) -> tuple[MtpHead, HeadWeights] | None:
    """Build the family's head and load its weights strictly; None when there is no head.

    `norm_shift` adds a constant to every head RMSNorm weight and `concat_order` overrides
    the projection's input order: both exist to show what a wrong conversion does.
    """
    hw = read_head_weights(model_dir, config)
    if hw is None:
        return None
    head = family_for(config).build_head(hw.num_layers or 1, hw.weights)
    if any(k.endswith(".scales") for k in hw.weights):
        qconfig = config.get("quantization") or config.get("quantization_config") or {}
        nn.quantize(
            head,
            group_size=int(qconfig.get("group_size", 64)),
            bits=int(qconfig.get("bits", 4)),
            class_predicate=quantization_predicate(hw.weights, qconfig, hw.prefix),
        )
    try:
        head.load_weights(list(hw.weights.items()), strict=True)
    except ValueError as e:  # names or shapes of another model's head
        raise MtpkitError(
            f"the MTP head in {model_dir} does not fit this model ({e}): graft the model's "
            "own head with `mtpkit convert ORIGINAL --mtp-only --into DIR`"
        ) from None
    head.eval()
    order = concat_order or (hw.manifest or {}).get("concat_order")
    if order:
        head.set_concat_order(order)
    if norm_shift:
        for _, module in head.named_modules():
            if isinstance(module, nn.RMSNorm):
                module.weight = module.weight + norm_shift
    mx.eval(head.parameters())
    return head, hw


def load_drafter_weights(
    model: nn.Module, weights: dict[str, mx.array], config: dict[str, Any], what: str
) -> None:
    """Load `weights` into a standalone drafter's `model` strictly, quantizing the layers
    whose weights carry scales first (`config`'s quantization block for the defaults);
    `what` names the drafter in the one-line error ("the drafter in DIR")."""
    from mtpkit.core.errors import MtpkitError, one_line

    if any(k.endswith(".scales") for k in weights):
        qconfig = config.get("quantization") or {}
        nn.quantize(
            model,
            group_size=int(qconfig.get("group_size", 64)),
            bits=int(qconfig.get("bits", 4)),
            class_predicate=quantization_predicate(weights, qconfig, ""),
        )
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise MtpkitError(f"{what} does not match its config.json ({one_line(e)})") from None


def parameter_bytes(module: nn.Module) -> int:
    """The bytes of `module`'s parameters (a drafter's cost is quoted as a share of its
    target's)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))
