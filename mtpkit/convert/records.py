"""What a conversion records beside the weights: the manifest of its plan
(`mtpkit.core.manifest.head_manifest`) and the output's config.json (the backbone as
mlx_lm.convert declares it, plus the head's quantization and MTP layer count).
"""

from __future__ import annotations

import copy
from typing import Any

from mtpkit.checkpoint.inspect import Checkpoint
from mtpkit.convert.plan import Plan, Settings
from mtpkit.convert.quant import dtype_name, is_floating
from mtpkit.core.manifest import MANIFEST_FORMAT, head_manifest
from mtpkit.families import Family
from mtpkit.families.base import expert_layout


def build_manifest(
    ckpt: Checkpoint, plan: Plan, settings: Settings, layers: int, *, backbone_quant: Any
) -> dict[str, Any]:
    """The manifest of a conversion; an mtpkit source keeps its first record."""
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
    return head_manifest(
        ckpt.family,
        model_type=ckpt.config.get("model_type"),
        source=source,
        num_layers=layers,
        layout=settings.layout,
        shifted=shifted,
        hidden=settings.hidden
        if settings.hidden_given
        else (previous or {}).get("hidden", settings.hidden),
        expert_layout={
            "source": expert_layout(plan.source_head_names),
            "output": expert_layout([n for n, _ in plan.head]),
        },
        mtp_dtype=head_dtypes[0] if len(head_dtypes) == 1 else (head_dtypes or None),
        head_quant=plan.head_quant,
        backbone_quant=backbone_quant,
        dropped=sorted(plan.dropped),
    )


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


def drafter_record(ckpt: Checkpoint, plan: Plan) -> dict[str, Any]:
    """The manifest's record of a standalone drafter (Gemma 4's assistant): what it is, the
    dtypes written, and what was done to its tied head and integer buffers."""
    floats = sorted(
        {
            dtype_name(a.dtype)
            for n, a in plan.backbone
            if is_floating(a.dtype) and not n.endswith((".scales", ".biases"))
        }
    )
    integers = {n: dtype_name(a.dtype) for n, a in plan.backbone if not is_floating(a.dtype)}
    integers = {n: d for n, d in integers.items() if not n.endswith(".weight")}
    return {
        "family": ckpt.family.name,
        "dtype": floats[0] if len(floats) == 1 else floats,
        "quantized": any(n.endswith(".scales") for n, _ in plan.backbone),
        "integer_buffers": integers,
        "tied_head": "dropped" if "lm_head.weight" in plan.dropped else "absent",
        "pairing": ckpt.family.pairing(),
    }
