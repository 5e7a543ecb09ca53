"""Loading an EAGLE-3 drafter at run time, pairing it with its target, and tapping the
target's layers it reads.

A drafter directory is a published one (config.json with `draft_vocab_size`, safetensors
with `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`) or mtpkit's conversion of one
(maybe quantized, config.json's `quantization` block). Either loads strictly here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.core.errors import MtpkitError
from mtpkit.families.eagle3 import Eagle3Layout, Eagle3Model, tensor_name, tensor_problem
from mtpkit.runtime.headload import load_drafter_weights


@dataclass
class Eagle3Drafter:
    """A loaded drafter: where it came from, its layout, its module, and the target id of
    each draft id (`d2t` applied; None: it drafts over the whole target vocabulary)."""

    path: Path
    layout: Eagle3Layout
    model: Eagle3Model
    target_ids: mx.array | None

    @property
    def parameter_bytes(self) -> int:
        from mtpkit.runtime.headload import parameter_bytes

        return parameter_bytes(self.model)


def eagle3_directory(spec: str | Path, revision: str | None = None) -> Path | None:
    """The local directory of `spec` (a directory or a Hub repo) when it is an EAGLE-3
    drafter, else None (`mtpkit.checkpoint.drafters.drafter_directory`)."""
    from mtpkit.checkpoint.drafters import drafter_directory

    return drafter_directory(spec, "eagle3", revision)


def read_weights(path: Path, layout: Eagle3Layout) -> dict[str, mx.array]:
    """The drafter's tensors in `Eagle3Model`'s names, `d2t` among them (`t2d` and a copy
    of the target's embedding left)."""
    weights: dict[str, mx.array] = {}
    for shard in sorted(path.glob("*.safetensors")):
        for name, array in mx.load(str(shard)).items():
            new = tensor_name(name)
            if new is not None and not layout.shared(new):
                weights[new] = array
    if not weights:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (it has {bins[0]}: mtpkit reads safetensors only)" if bins else ""
        raise MtpkitError(f"{path} has no safetensors weights{hint}: pass the drafter's directory")
    return weights


def target_ids_of(d2t: mx.array | None, layout: Eagle3Layout, where: str) -> mx.array | None:
    """Each draft id's target id (`i + d2t[i]`), checked to be distinct target ids."""
    if not layout.maps_vocabulary and (d2t is None or not mx.any(d2t).item()):
        return None
    if d2t is None or d2t.shape != (layout.draft_vocab_size,):
        shape = None if d2t is None else tuple(d2t.shape)
        raise MtpkitError(
            f"{where}: d2t has shape {shape}, not ({layout.draft_vocab_size},) as its "
            "draft_vocab_size says"
        )
    ids = (mx.arange(layout.draft_vocab_size) + d2t.astype(mx.int64)).tolist()
    if min(ids) < 0 or max(ids) >= layout.vocab_size or len(set(ids)) != len(ids):
        raise MtpkitError(
            f"{where}: d2t maps draft ids outside the target vocabulary of "
            f"{layout.vocab_size} or two onto one token; use the drafter as published"
        )
    return mx.array(ids, dtype=mx.int32)


def load_eagle3(path: str | Path) -> Eagle3Drafter:
    """The drafter in `path` (a directory), weights loaded strictly."""
    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.exists():
        raise MtpkitError(f"{path} has no config.json: pass the drafter's directory")
    config = json.loads(config_path.read_text())
    layout = Eagle3Layout.of(config, str(path))
    problems = layout.intrinsic_problems()
    if problems:
        raise MtpkitError(f"the EAGLE-3 drafter in {path} cannot draft: {problems[0]}")
    weights = read_weights(path, layout)
    problem = tensor_problem(layout, weights)
    if problem is not None:
        raise MtpkitError(f"the drafter in {path} does not match its config.json: {problem}")
    target_ids = target_ids_of(weights.pop("d2t", None), layout, f"the drafter in {path}")
    model = Eagle3Model(layout)
    load_drafter_weights(model, weights, config, f"the drafter in {path}")
    # Loaded now, on this thread's stream (a server decodes on another thread).
    mx.eval(model.parameters(), target_ids if target_ids is not None else [])
    model.eval()
    return Eagle3Drafter(path, layout, model, target_ids)


def check_target(drafter: Eagle3Drafter, target_config: dict[str, Any], rows: int,
                 names: tuple[str, str]) -> None:  # fmt: skip
    """Refuse a drafter that cannot draft for the target (one line naming why); `rows`: the
    rows of the target's embedding (every mapped draft id must be one)."""
    text = target_config.get("text_config") or target_config
    problems = drafter.layout.target_problems(text)
    if drafter.layout.vocab_size > rows:
        problems.append(f"its vocabulary of {drafter.layout.vocab_size} is past the target's {rows} embeddings")
    if problems:
        raise MtpkitError(
            f"{names[0]} is an EAGLE-3 drafter for another target than {names[1]}: "
            f"{problems[0]}; use the drafter published for this target"
        )


def tap_layer_inputs(m: Any, ids: tuple[int, ...]) -> None:
    """From now on a pass's hidden state is the inputs of target layers `ids` (each >= 1:
    the output of the layer before), concatenated: what EAGLE-3 fuses (`MtpModel.tap_layers`,
    logits unchanged)."""
    m.tap_layers(tuple(i - 1 for i in ids))
