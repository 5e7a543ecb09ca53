"""Loading a DFlash drafter at run time and pairing it with its target.

A drafter directory is z-lab's published one (config.json with `dflash_config`, bf16
safetensors, no embedding or output head) or mtpkit's conversion of one (maybe quantized,
config.json's `quantization` block). Either loads strictly here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.families.dflash import DFlashLayout, DFlashModel, tensor_name, tensor_problem
from mtpkit.runtime.headload import load_drafter_weights


@dataclass
class DFlashDrafter:
    """A loaded drafter: where it came from, its layout and its module."""

    path: Path
    layout: DFlashLayout
    model: DFlashModel

    @property
    def parameter_bytes(self) -> int:
        from mtpkit.runtime.headload import parameter_bytes

        return parameter_bytes(self.model)


def dflash_directory(spec: str | Path, revision: str | None = None) -> Path | None:
    """The local directory of `spec` (a directory or a Hub repo) when it is a DFlash
    drafter, else None (`mtpkit.checkpoint.drafters.drafter_directory`)."""
    from mtpkit.checkpoint.drafters import drafter_directory

    return drafter_directory(spec, "dflash", revision)


def read_weights(path: Path) -> dict[str, mx.array]:
    """The drafter's tensors in `DFlashModel`'s names (those shared with the target left)."""
    weights: dict[str, mx.array] = {}
    for shard in sorted(path.glob("*.safetensors")):
        for name, array in mx.load(str(shard)).items():
            new = tensor_name(name)
            if new is not None:
                weights[new] = array
    if not weights:
        raise MtpkitError(f"{path} has no safetensors weights: pass the drafter's directory")
    return weights


def load_dflash(path: str | Path) -> DFlashDrafter:
    """The drafter in `path` (a directory), weights loaded strictly."""
    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.exists():
        raise MtpkitError(f"{path} has no config.json: pass the drafter's directory")
    config = json.loads(config_path.read_text())
    layout = DFlashLayout.of(config, str(path))
    problems = layout.intrinsic_problems()
    if problems:
        raise MtpkitError(f"the DFlash drafter in {path} cannot draft: {problems[0]}")
    weights = read_weights(path)
    problem = tensor_problem(layout, weights)
    if problem is not None:
        raise MtpkitError(f"the drafter in {path} does not match its config.json: {problem}")
    model = DFlashModel(layout)
    load_drafter_weights(model, weights, config, f"the drafter in {path}")
    # Loaded now, on this thread's stream (a server decodes on another thread).
    mx.eval(model.parameters())
    model.eval()
    return DFlashDrafter(path, layout, model)


def check_target(drafter: DFlashDrafter, target_config: dict[str, Any], vocab: int,
                 names: tuple[str, str]) -> None:  # fmt: skip
    """Refuse a drafter that cannot draft for the target (one line naming why); `vocab`:
    the rows of the target's embedding (the mask token must be one)."""
    text = target_config.get("text_config") or target_config
    problems = drafter.layout.target_problems(text)
    mask = drafter.layout.mask_token_id
    if mask is not None and mask >= vocab:
        problems.append(f"its mask token {mask} is outside the target's {vocab} embeddings")
    if problems:
        raise MtpkitError(
            f"{names[0]} is a DFlash drafter for another target than {names[1]}: "
            f"{problems[0]}; use the drafter published for this target"
        )
