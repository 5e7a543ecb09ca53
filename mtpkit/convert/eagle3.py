"""`mtpkit convert` of an EAGLE-3 drafter: an MLX drafter directory in its published names
(`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`), bf16 (or `--dtype`), its linear
layers quantized with `-q` as a head's are (`--mtp-bits`, else `--q-bits`;
`--keep-mtp-bf16` keeps them whole). The vocabulary maps keep their integer dtypes.

Only the drafter's files are fetched (config.json and its safetensors); a copy of the
target's embedding some exports carry is left out (`Eagle3Layout.shared`). The directory is
written into a temporary sibling and renamed at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.convert.drafter import DTYPES, drafter_spec
from mtpkit.convert.plan import Settings
from mtpkit.convert.quant import dtype_name, is_floating, quantize
from mtpkit.core.errors import MtpkitError
from mtpkit.families.eagle3 import VOCAB_MAPS, Eagle3Layout, tensor_name, tensor_problem

LINEAR = ("_proj.weight", "fc.weight", "lm_head.weight")


def read_tensors(source_dir: Path, layout: Eagle3Layout) -> dict[str, mx.array]:
    """The drafter's tensors in its published names, `t2d` kept, a shared embedding left."""
    weights: dict[str, mx.array] = {}
    for shard in sorted(source_dir.glob("*.safetensors")):
        for name, array in mx.load(str(shard)).items():
            new = tensor_name(name) or name.removeprefix("model.")  # t2d: kept as it is
            if not layout.shared(new):
                weights[new] = array
    return weights


def convert_eagle3(source_dir: Path, out: Path, settings: Settings, *, force: bool) -> dict[str, Any]:
    """Write the MLX drafter of `source_dir` to `out`; returns what was done (the record
    `ConvertResult.manifest` carries)."""
    from mtpkit.convert.destination import new_directory

    config = json.loads((source_dir / "config.json").read_text())
    layout = Eagle3Layout.of(config, str(source_dir))
    problems = layout.intrinsic_problems()
    if problems:
        raise MtpkitError(f"the EAGLE-3 drafter in {source_dir} cannot draft: {problems[0]}")
    weights = read_tensors(source_dir, layout)
    problem = tensor_problem(layout, weights) if weights else "it has no safetensors weights"
    if problem is not None:
        raise MtpkitError(f"the drafter in {source_dir} does not match its config.json: {problem}")
    dtype = DTYPES[settings.dtype or "bfloat16"]
    spec = drafter_spec(settings)
    quantized = any(n.endswith(".scales") for n in weights)
    out_weights: dict[str, mx.array] = {}
    for name, array in weights.items():
        if name in VOCAB_MAPS or not is_floating(array.dtype) or name.endswith((".scales", ".biases")):
            out_weights[name] = array
            continue
        array = array.astype(dtype)
        linear = name.endswith(LINEAR) and array.ndim == 2
        if spec is not None and not quantized and linear and array.shape[-1] % spec.group_size == 0:
            prefix = name.removesuffix(".weight")
            out_weights.update({f"{prefix}.{k}": v for k, v in quantize(array, spec).items()})
        else:
            out_weights[name] = array
    if spec is not None and not quantized:
        config["quantization"] = spec.as_config()
    config["torch_dtype"] = dtype_name(dtype)
    record = {
        "drafter": "eagle3",
        "source": str(source_dir),
        "dtype": config["torch_dtype"],
        "quantization": config.get("quantization"),
        "tensors": len(out_weights),
        "draft_vocab_size": layout.draft_vocab_size,
    }
    with new_directory(out, force=force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), out_weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return record
