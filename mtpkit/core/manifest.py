"""The record of every decision a conversion made, kept beside the MTP head.

mtpkit writes the head to `mtp/weights.safetensors` and this manifest to
`mtp/manifest.json` (the vllm-mlx sidecar layout, whose `rmsnorm_weight_format` key it keeps
for compatibility). Neither file matches `model*.safetensors`, so stock mlx-lm never reads
the head. Later steps (inspect, generate, check, convert again) read these facts instead
of guessing them from tensor statistics, which are known to mislead.

Keys written by `mtpkit convert` (stable; `MANIFEST_KEYS` lists them):

- `format`: always "mtpkit"; `mtpkit_version`: the version that wrote it.
- `family`, `model_type`: mtpkit's family and the config's model_type.
- `source`: `{spec, revision, commit}` of the original checkpoint (kept when an mtpkit
  output is converted again).
- `weights`: the head file beside the manifest ("weights.safetensors").
- `prefix`: the head tensors' name prefix ("language_model.mtp." for Qwen3.5/3.6, "mtp." for
  the others); `num_layers`: MTP layers in the head.
- `layout`: "sidecar" (head only in mtp/) or "inline" (also in the model shards).
- `rmsnorm_weight_format`: "mlx_gamma" (zero-centred norms shifted +1) or "plain".
- `norm_shift`: `{backbone: [keys], mtp: [keys], dtype}`: every tensor mtpkit shifted +1,
  and the dtype the addition was done in ("float32"; null when nothing was shifted).
- `hidden`: "post_norm" or "pre_norm", the hidden state the head expects;
  `concat_order`: "embedding_first" or "hidden_first".
- `expert_layout`: `{source, output}`: "per_expert", "fused", "stacked", "dense".
- `mtp_dtype`: dtype of the head's unquantized tensors; `mtp_quantization`: null or
  `{bits, group_size, mode}` (the setting most head modules use); `mtp_quantization_paths`:
  every quantizable head module path -> false or `{group_size, bits, mode}` (as in
  config.json).
- `backbone_quantization`: null or `{bits, group_size, mode}`, plus `predicate` (mlx-lm's
  mixed recipe, e.g. "mixed_3_6") when one chose the bits per layer.
- `dropped`: source tensors deliberately not written (duplicated embeddings and heads,
  tied lm_head, vision tower, rotary buffers).
- `grafted_into`: only after `--mtp-only --into DIR`, the directory grafted into.

This module also builds the output's config.json (the backbone as mlx_lm.convert declares it,
plus the head's quantization and MTP layer count), the other record a conversion leaves.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpkit import __version__
from mtpkit.convert.quant import dtype_name, is_floating
from mtpkit.families.base import expert_layout

if TYPE_CHECKING:
    from mtpkit.checkpoint.inspect import Checkpoint
    from mtpkit.convert.plan import Plan, Settings
    from mtpkit.families import Family

MANIFEST_PATH = "mtp/manifest.json"
HEAD_WEIGHTS_PATH = "mtp/weights.safetensors"
MANIFEST_FORMAT = "mtpkit"

# Head files other tools write; inspect and generate read them too.
SIDECAR_WEIGHTS = (HEAD_WEIGHTS_PATH, "mtp.safetensors", "model-mtp.safetensors")

# `rmsnorm_weight_format` values: `mlx_gamma` means the weight is what mlx-lm's RMSNorm
# multiplies by (zero-centred weights already shifted by +1); `zero_centred` means not yet.
SHIFTED = "mlx_gamma"
UNSHIFTED = "zero_centred"
PLAIN = "plain"

MANIFEST_KEYS = (
    "format",
    "mtpkit_version",
    "family",
    "model_type",
    "source",
    "weights",
    "prefix",
    "num_layers",
    "layout",
    "rmsnorm_weight_format",
    "norm_shift",
    "hidden",
    "concat_order",
    "expert_layout",
    "mtp_dtype",
    "mtp_quantization",
    "mtp_quantization_paths",
    "backbone_quantization",
    "dropped",
)


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write a manifest (indented JSON, keys in MANIFEST_KEYS order first)."""
    ordered = {k: manifest[k] for k in MANIFEST_KEYS if k in manifest}
    ordered.update({k: v for k, v in manifest.items() if k not in ordered})
    path.write_text(json.dumps(ordered, indent=2) + "\n")


def norm_convention(manifest: dict[str, Any] | None) -> str | None:
    """The norm convention a manifest records, as inspect reports it, or None."""
    if not manifest:
        return None
    fmt = manifest.get("rmsnorm_weight_format")
    return {SHIFTED: "shifted", UNSHIFTED: "zero_centred", PLAIN: "plain"}.get(fmt)


def head_layer_count(head_prefix: str, names: list[str]) -> int:
    """MTP layers present, from the head's tensor names (`{prefix}layers.{i}.`)."""
    prefix = head_prefix + "layers."
    return len({n[len(prefix) :].split(".", 1)[0] for n in names if n.startswith(prefix)})


def build_manifest(
    ckpt: Checkpoint, plan: Plan, settings: Settings, layers: int, *, backbone_quant: Any
) -> dict[str, Any]:
    """The manifest of a conversion (keys above); an mtpkit source keeps its first record."""
    family = ckpt.family
    previous = ckpt.manifest if (ckpt.manifest or {}).get("format") == MANIFEST_FORMAT else None
    source = {
        "spec": ckpt.source.spec,
        "revision": ckpt.source.revision,
        "commit": ckpt.source.commit,
    }
    shifted = {"backbone": sorted(plan.shifted["backbone"]), "mtp": sorted(plan.shifted["head"])}
    if previous is not None:
        # Converting mtpkit's own output: the first conversion's record stays the truth.
        source = previous.get("source", source)
        old = previous.get("norm_shift") or {}
        shifted = {
            "backbone": sorted(set(old.get("backbone", [])) | set(shifted["backbone"])),
            "mtp": sorted(set(old.get("mtp", [])) | set(shifted["mtp"])),
        }
    head_dtypes = sorted(
        {
            dtype_name(a.dtype)
            for n, a in plan.head
            if is_floating(a.dtype) and not n.endswith((".scales", ".biases"))
        }
    )
    return {
        "format": MANIFEST_FORMAT,
        "mtpkit_version": __version__,
        "family": family.name,
        "model_type": ckpt.config.get("model_type"),
        "source": source,
        "weights": Path(HEAD_WEIGHTS_PATH).name,
        "prefix": family.head_prefix,
        "num_layers": layers,
        "layout": settings.layout,
        "rmsnorm_weight_format": SHIFTED if family.zero_centred_norms else PLAIN,
        "norm_shift": {
            **shifted,
            "dtype": "float32" if (shifted["backbone"] or shifted["mtp"]) else None,
        },
        "hidden": settings.hidden
        if settings.hidden_given
        else (previous or {}).get("hidden", settings.hidden),
        "concat_order": family.concat_order,
        "expert_layout": {
            "source": expert_layout(plan.source_head_names),
            "output": expert_layout([n for n, _ in plan.head]),
        },
        "mtp_dtype": head_dtypes[0] if len(head_dtypes) == 1 else (head_dtypes or None),
        "mtp_quantization": _main_quantization(plan.head_quant),
        "mtp_quantization_paths": plan.head_quant,
        "backbone_quantization": backbone_quant,
        "dropped": sorted(plan.dropped),
    }


def _main_quantization(paths: dict[str, Any]) -> dict[str, Any] | None:
    """The (bits, group_size, mode) most quantized head modules use, or None."""
    counts: dict[tuple[int, int, str], int] = {}
    for v in paths.values():
        if v:
            key = (v["bits"], v["group_size"], v.get("mode", "affine"))
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    bits, group, mode = max(counts, key=lambda k: counts[k])
    return {"bits": bits, "group_size": group, "mode": mode}


def output_config(ckpt: Checkpoint, plan: Plan, settings: Settings, layers: int) -> dict[str, Any]:
    """config.json as mlx_lm.convert writes it (with mlx-lm's load_config's eos_token_id),
    plus the head's quantization and the MTP declaration."""
    config = copy.deepcopy(ckpt.config)
    generation = (
        ckpt.source.read_json("generation_config.json")
        if ckpt.source.has("generation_config.json")
        else None
    )
    if isinstance(generation, dict) and generation.get("eos_token_id"):
        config["eos_token_id"] = generation["eos_token_id"]
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
        config.pop("quantization_config")  # dequantized: the weights are no longer FP8
    quant: dict[str, Any] | None = config.get("quantization")
    spec = settings.backbone_spec()
    if spec is not None:
        quant = spec.as_config()
        quant.update(plan.quant_overrides)
    set_quantization(config, quant, ckpt.family, plan, settings)
    if layers:
        ckpt.family.declare_mtp(config, layers)
    return config


def set_quantization(
    config: dict[str, Any],
    quant: dict[str, Any] | None,
    family: Family,
    plan: Plan,
    settings: Settings,
) -> None:
    """Write the backbone's quantization (`quant`, any old head entries dropped) plus one entry
    per head module into `config`, as mlx-lm's loader reads them."""
    if quant is not None:
        quant = {k: v for k, v in quant.items() if not k.startswith(family.head_prefix)}
    if quant is None and any(plan.head_quant.values()):
        spec = settings.head_spec()
        assert spec is not None
        quant = spec.as_config()
    if quant is not None:
        quant.update(plan.head_quant)
        config["quantization"] = quant
        config["quantization_config"] = quant
