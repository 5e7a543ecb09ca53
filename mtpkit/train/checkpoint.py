"""Checkpoints of a `train-head` run: the head, the optimizer and where the data stream was.

A checkpoint is one unit, complete or absent. The tensor files of step N are written under
names of their own (`head-N.safetensors`, `optimizer-N.safetensors`, each a temporary name
renamed when complete, each recording its step), then `state.json`, which names step N, replaces
the previous one: that rename is the moment the new checkpoint exists. Only then are the files
of earlier steps removed. A run killed at any moment leaves the previous checkpoint or the
new one; a resume reads exactly the files `state.json` names and refuses, with one line, a
damaged checkpoint or one whose files disagree on the step.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mtpkit.core.errors import MtpkitError, more_of
from mtpkit.families.head import MtpHead

STATE_FILE = "state.json"
PARTS = ("head", "optimizer")
PART_FILE = re.compile(r"^(?:head|optimizer)-(\d+)\.safetensors$")
TEMP_FILE = re.compile(r"^\.(?:head|optimizer)-\d+\.tmp\.safetensors$")
# Settings a resumed run must share with the checkpoint (the batches depend on them).
RESUME_KEYS = ("batch_size", "seq_len", "seed", "depth", "data")


class CheckpointError(MtpkitError):
    """No checkpoint to resume from, one made by another run, or a damaged one."""


def finite(tensor: mx.array) -> bool:
    """Whether a tensor holds no NaN or Inf (integer tensors always do)."""
    if not mx.issubdtype(tensor.dtype, mx.floating):
        return True
    return bool(mx.isfinite(tensor).all().item())


def part_file(directory: Path, part: str, step: int) -> Path:
    return directory / f"{part}-{step}.safetensors"


def save_checkpoint(
    directory: Path, head: MtpHead, opt: optim.Optimizer, state: dict[str, Any]
) -> None:
    """Head, optimizer and run `state` (with its `step`) into `directory`, as one unit."""
    directory.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    tmp = directory / f".{STATE_FILE}.tmp"
    try:
        for part, tree in (("head", head.parameters()), ("optimizer", opt.state)):
            final = part_file(directory, part, step)
            tmp = directory / f".{part}-{step}.tmp.safetensors"  # mlx adds a missing suffix
            mx.save_safetensors(str(tmp), dict(tree_flatten(tree)), {"step": str(step)})
            os.replace(tmp, final)
        tmp = directory / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=1) + "\n")
    except (OSError, RuntimeError) as e:  # a full disk: MLX's writer raises RuntimeError
        # This step's files are not a checkpoint until state.json names them: remove them.
        tmp.unlink(missing_ok=True)
        for part in PARTS:
            part_file(directory, part, step).unlink(missing_ok=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise CheckpointError(
            f"writing the checkpoint of step {step} into {directory} failed ({reason}); the "
            "previous checkpoint is kept: free some space, or pass another --checkpoint-dir"
        ) from None
    os.replace(tmp, directory / STATE_FILE)  # the new checkpoint exists from here on
    for entry in directory.iterdir():  # earlier steps', and what a killed save left
        match = PART_FILE.match(entry.name)
        if (match and int(match[1]) != step) or TEMP_FILE.match(entry.name):
            entry.unlink(missing_ok=True)


def remove_checkpoint(directory: Path, *, created: bool) -> None:
    """Remove the files a run's checkpoints left in `directory` (its state, head and
    optimizer files, and what a killed save left), never anything else: `--checkpoint-dir`
    may name a directory that holds the user's own files. The directory itself goes only if
    the run `created` it and nothing else is left in it."""
    if not directory.is_dir() or directory.is_symlink():
        return
    for entry in directory.iterdir():
        name = entry.name
        ours = name in (STATE_FILE, f".{STATE_FILE}.tmp") or PART_FILE.match(name)
        if (ours or TEMP_FILE.match(name)) and (entry.is_file() or entry.is_symlink()):
            entry.unlink(missing_ok=True)
    if created:
        try:
            directory.rmdir()
        except OSError:  # something else is there now: it is not ours to remove
            pass


def read_state(directory: Path) -> dict[str, Any]:
    """The checkpoint's `state.json`, checked for what a resume relies on."""
    path = directory / STATE_FILE
    if not path.exists():
        raise CheckpointError(f"--resume: no checkpoint in {directory} (no {STATE_FILE})")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(
            f"--resume: {path} is damaged ({type(e).__name__}): delete {directory} and train "
            "from the start"
        ) from None
    fault = state_fault(state)
    if fault is not None:
        raise CheckpointError(
            f"--resume: {path} is damaged ({fault}): delete {directory} and train from the start"
        )
    return state


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number_or_none(value: Any) -> bool:
    return value is None or (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    )


def state_fault(state: Any) -> str | None:
    """What is wrong with a `state.json` as `save_checkpoint` writes it, or None: a step >= 1,
    the chunks its batches consumed (step x batch_size, so a resume skips exactly those and no
    10**12 of them), the settings, one finite loss per step and evaluations of earlier steps."""
    if not isinstance(state, dict):
        return "not a JSON object"
    step, settings = state.get("step"), state.get("settings")
    if not _count(step) or step < 1:
        return f"step {step!r} is not a positive whole number"
    if not isinstance(settings, dict) or not _count(settings.get("batch_size")):
        return "no settings with a batch size"
    if not isinstance(state.get("model"), str):
        return "no model"
    if state.get("chunks") != step * settings["batch_size"]:
        return (
            f"chunks {state.get('chunks')!r} is not step x batch_size "
            f"({step} x {settings['batch_size']})"
        )
    losses = state.get("losses")
    if not isinstance(losses, list) or len(losses) != step:
        return f"losses is not a list of {step} numbers"
    if not all(_number_or_none(x) and x is not None for x in losses):
        return "a loss is not a finite number"
    history = state.get("history")
    if not isinstance(history, list) or not all(
        isinstance(h, dict)
        and _count(h.get("step"))
        and h["step"] <= step
        and _number_or_none(h.get("loss"))
        and _number_or_none(h.get("heldout_acceptance"))
        for h in history
    ):
        return "history is not a list of {step, loss, heldout_acceptance} of earlier steps"
    return None


def _load_part(directory: Path, part: str, step: int) -> dict[str, mx.array]:
    path = part_file(directory, part, step)
    if not path.exists():
        raise CheckpointError(
            f"--resume: the checkpoint in {directory} is incomplete ({path.name}, named by "
            f"{STATE_FILE}, is missing): delete {directory} and train from the start"
        )
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(
            f"--resume: {path} is damaged ({str(e).splitlines()[0] if str(e) else type(e).__name__}): "
            f"delete {directory} and train from the start"
        ) from None
    if metadata.get("step") != str(step):
        raise CheckpointError(
            f"--resume: {path} is of step {metadata.get('step')} but {STATE_FILE} names step "
            f"{step}: the checkpoint is a mix of two runs; delete {directory} and train from "
            "the start"
        )
    return tensors


def load_checkpoint(
    directory: Path,
    head: MtpHead,
    opt: optim.Optimizer,
    settings: dict[str, Any],
    model: str,
) -> dict[str, Any]:
    """Load the head and optimizer of the checkpoint in `directory` and return its state,
    after checking it was made for `model` with the same `settings` (`RESUME_KEYS`)."""
    state = read_state(directory)
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
    step = state["step"]
    weights = _load_part(directory, "head", step)
    optimizer = _load_part(directory, "optimizer", step)
    unusable = [k for k, v in (*weights.items(), *optimizer.items()) if not finite(v)]
    if unusable:
        raise CheckpointError(
            f"--resume: the checkpoint in {directory} holds NaN or Inf ({unusable[0]}"
            f"{more_of(unusable)}): delete {directory} and train from the start"
        )
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise CheckpointError(
            f"--resume: the head in {directory} does not fit this model ({str(e).splitlines()[0]}): "
            f"delete {directory} and train from the start"
        ) from None
    expected = {k: v.shape for k, v in tree_flatten(opt.state)}
    found = {k: v.shape for k, v in optimizer.items()}
    if found != expected:
        raise CheckpointError(
            f"--resume: the optimizer state in {directory} does not fit this head: delete "
            f"{directory} and train from the start"
        )
    opt.state = tree_unflatten(list(optimizer.items()))
    return state
