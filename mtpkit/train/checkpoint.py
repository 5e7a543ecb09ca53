"""Checkpoints of a `train-head` run: the head, the optimizer and where the data stream was.

Each file is written to a temporary name and renamed, the state file last (it names the step
the two tensor files belong to), so a run killed at any moment leaves the previous
checkpoint or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mtpkit.core.errors import MtpkitError
from mtpkit.families.head import MtpHead

STATE_FILE = "state.json"
# Settings a resumed run must share with the checkpoint (the batches depend on them).
RESUME_KEYS = ("batch_size", "seq_len", "seed", "depth", "data")


class CheckpointError(MtpkitError):
    """No checkpoint to resume from, or one made by another run."""


def save_checkpoint(
    directory: Path, head: MtpHead, opt: optim.Optimizer, state: dict[str, Any]
) -> None:
    """Head, optimizer and run `state` (with its `step`) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    step = state["step"]
    for name, tree in (("head", head.parameters()), ("optimizer", opt.state)):
        tmp = directory / f".{name}-{step}.tmp.safetensors"
        mx.save_safetensors(str(tmp), dict(tree_flatten(tree)))
        os.replace(tmp, directory / f"{name}.safetensors")
    tmp = directory / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, directory / STATE_FILE)


def load_checkpoint(
    directory: Path,
    head: MtpHead,
    opt: optim.Optimizer,
    settings: dict[str, Any],
    model: str,
) -> dict[str, Any]:
    """Load the head and optimizer of the checkpoint in `directory` and return its state,
    after checking it was made for `model` with the same `settings` (`RESUME_KEYS`)."""
    path = directory / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"--resume: no checkpoint in {directory}")
    state = json.loads(path.read_text())
    recorded = state.get("settings", {})
    for key in RESUME_KEYS:
        if recorded.get(key) != settings.get(key):
            raise CheckpointError(
                f"--resume: the checkpoint in {directory} was made with {key}="
                f"{recorded.get(key)!r}, not {settings.get(key)!r}"
            )
    if state.get("model") != model:
        raise CheckpointError(
            f"--resume: the checkpoint in {directory} trains {state.get('model')}, not {model}"
        )
    head.load_weights(list(mx.load(str(directory / "head.safetensors")).items()), strict=True)
    opt.state = tree_unflatten(list(mx.load(str(directory / "optimizer.safetensors")).items()))
    return state
