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

from mtpkit.convert.drafter import drafter_tensors, save_drafter
from mtpkit.convert.plan import Settings
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
    config = json.loads((source_dir / "config.json").read_text())
    layout = Eagle3Layout.of(config, str(source_dir))
    problems = layout.intrinsic_problems()
    if problems:
        raise MtpkitError(f"the EAGLE-3 drafter in {source_dir} cannot draft: {problems[0]}")
    weights = read_tensors(source_dir, layout)
    problem = tensor_problem(layout, weights) if weights else "it has no safetensors weights"
    if problem is not None:
        raise MtpkitError(f"the drafter in {source_dir} does not match its config.json: {problem}")
    out_weights = drafter_tensors(weights, settings, config, LINEAR, VOCAB_MAPS)
    record = {
        "drafter": "eagle3",
        "source": str(source_dir),
        "dtype": config["torch_dtype"],
        "quantization": config.get("quantization"),
        "tensors": len(out_weights),
        "draft_vocab_size": layout.draft_vocab_size,
    }
    save_drafter(out, config, out_weights, force=force)
    return record
