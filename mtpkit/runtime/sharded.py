"""Loading a model over the ranks of `mlx.launch`: each rank reads only its part.

The backbone is sharded the way mlx-lm's `sharded_load` shards it, through the model's own
methods: pipeline stages through the decoder stack's `pipeline()` (rank 0 holds the last
layers), tensor parallelism through the model's `shard()`. The MTP head needs the final
hidden state, which both leave on every rank: under pipeline parallelism it runs on rank 0
only (the last stage) and only rank 0 reads it; under tensor parallelism every rank runs it,
since mlx-lm may shard the lm_head the head drafts through (`MtpModel.lm_head` gathers it).

From a Hub repo each rank downloads only the files its part needs, as `sharded_load` does,
one request at a time, each bounded by the Hub timeouts (as one process downloads).

Before any weights are read, the ranks agree on the model: its config.json and mtpkit's
manifest (`mtpkit.runtime.ranks.agree`), so that ranks given different models stop with one
line instead of decoding a hybrid of the two. The CLI compares them earlier still, in the
ranks' first exchange (`given_model_facts`, `mtpkit.cli.ranks.on_ranks`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.checkpoint.source import HubSource, open_source
from mtpkit.core.errors import MtpkitError
from mtpkit.core.manifest import MANIFEST_PATH
from mtpkit.families import backbone_parts
from mtpkit.runtime.headload import SIDECAR_FILES, load_head
from mtpkit.runtime.model import (
    MODEL_FILES,
    MtpModel,
    assemble,
    head_tensor_filter,
    load_tokenizer,
    model_classes_without,
)
from mtpkit.runtime.ranks import Lockstep, agree, facts_of, local_work

PIPELINE = "pipeline"
TENSOR = "tensor"


class ShardingError(MtpkitError):
    """The model cannot be spread over the ranks as asked."""


def world() -> Any:
    """The group of `mlx.launch`'s ranks, or None when this is a single process."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def sharding_modes(model: nn.Module, config: dict[str, Any]) -> list[str]:
    """How mlx-lm's model can be spread: `pipeline` when its decoder stack has `pipeline()`,
    `tensor` when the model has `shard()`."""
    modes = []
    if hasattr(model, "shard"):
        modes.append(TENSOR)
    if hasattr(backbone_parts(model, config).decoder, "pipeline"):
        modes.append(PIPELINE)
    return modes


def choose_mode(model: nn.Module, config: dict[str, Any], pipeline: bool) -> str:
    """Tensor parallelism where mlx-lm's model has it (mlx-lm's default), pipeline stages
    where it has only those or `pipeline` asks for them."""
    modes = sharding_modes(model, config)
    model_type = config.get("model_type")
    if not modes:
        raise ShardingError(
            f"mlx-lm's {model_type} model supports neither pipeline() nor shard(), so it "
            "cannot be spread over machines: run it on one machine (without mlx.launch)"
        )
    if pipeline and PIPELINE not in modes:
        raise ShardingError(
            f"mlx-lm's {model_type} model has no pipeline(): drop --pipeline (it runs tensor "
            "parallel)"
        )
    return PIPELINE if pipeline or TENSOR not in modes else TENSOR


def _local_path(spec: str, revision: str | None) -> tuple[Path, HubSource | None]:
    """The directory to load from: a local one, or the Hub snapshot with every file but the
    weights (each rank fetches its own weights later)."""
    source = open_source(spec, revision=revision)
    if not isinstance(source, HubSource):
        local = Path(spec).expanduser()
        return (local if local.is_dir() else source.root), None
    return source.download([p for p in MODEL_FILES if p != "*.safetensors"]), source


def model_facts(path: Path) -> dict[str, str]:
    """What ranks must share about their model: config.json and mtpkit's manifest (but the
    version of mtpkit that wrote it), key by key."""

    def read(name: str) -> dict[str, Any]:
        try:
            return json.loads((path / name).read_text())
        except (OSError, ValueError):
            return {}

    config, manifest = read("config.json"), read(MANIFEST_PATH)
    manifest.pop("mtpkit_version", None)
    # model_type first: a rank given another family is named by it.
    config = {"model_type": config.get("model_type"), **config}
    return facts_of({"config.json": config, MANIFEST_PATH: manifest})


def given_model_facts(spec: str | Path, revision: str | None = None) -> dict[str, str]:
    """`model_facts` of the model `spec` names, its files but the weights fetched from the
    Hub where it is a repo: what a rank compares with the others as soon as they join."""
    return model_facts(_local_path(str(spec), revision)[0])


def place(model: nn.Module, config: dict[str, Any], group: Any, mode: str) -> str:
    """Spread `model` (lazy) over `group` in `mode`; tensor parallelism that cannot split
    the model's sizes that many ways falls back to pipeline stages where the model has them.
    Returns the mode used."""
    if mode == PIPELINE:
        backbone_parts(model, config).decoder.pipeline(group)
        return mode
    try:
        model.shard(group)
    except ValueError as e:  # e.g. "The input of size 128 cannot be sharded across 3 devices"
        if PIPELINE not in sharding_modes(model, config):
            raise ShardingError(
                f"mlx-lm's {config.get('model_type')} model cannot be split over "
                f"{group.size()} ranks ({e}): use a number of ranks that divides its sizes"
            ) from None
        return PIPELINE  # the caller builds the model again: shard() changed this one
    return mode


def _rank_files(
    path: Path, config: dict[str, Any], stage: tuple[int, int] | None, with_head: bool
) -> list[str]:
    """The weight files a rank needs: for a pipeline stage [start, end) the shards holding
    its layers and every tensor outside the layers (embedding, final norm, lm_head: every
    stage keeps them), as mlx-lm's `sharded_load` picks them; all of them otherwise. The
    head's shards and sidecar files only where the head runs."""
    index_file = path / "model.safetensors.index.json"
    if not index_file.exists():
        return ["model*.safetensors", *(SIDECAR_FILES if with_head else ())]
    weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    is_head = head_tensor_filter(config)
    files = set()
    for name, file in weight_map.items():
        if is_head(name):
            if with_head:
                files.add(file)
            continue
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if stage is None or found is None or stage[0] <= int(found.group(1)) < stage[1]:
            files.add(file)
    return sorted(files) + (list(SIDECAR_FILES) + ["mtp/*"] if with_head else [])


def load_sharded(
    spec: str | Path,
    group: Any,
    *,
    pipeline: bool = False,
    hidden: str | None = None,
    with_head: bool = True,
    revision: str | None = None,
) -> MtpModel:
    """This rank's part of the model (see the module's docstring), ready to decode in
    lockstep with the other ranks of `group`."""
    from mlx_lm.utils import load_model as mlx_load_model

    with local_work():
        path, hub = _local_path(str(spec), revision)
    if not (path / "config.json").exists():
        raise MtpkitError(f"{spec} has no config.json: pass a model directory")

    def classes(config: dict[str, Any]) -> tuple[type[nn.Module], type]:
        return model_classes_without(config, head_tensor_filter(config))

    def lazy_model() -> tuple[nn.Module, dict[str, Any]]:
        try:
            return mlx_load_model(path, lazy=True, strict=False, get_model_classes=classes)
        except (ValueError, FileNotFoundError) as e:
            raise MtpkitError(f"mlx-lm cannot load {path}: {e}") from None

    with local_work():
        model, config = lazy_model()
    agree(group, {"model": model_facts(path)})  # as `mtpkit.cli.ranks` did at the join
    mode = choose_mode(model, config, pipeline)
    if mode == TENSOR and place(model, config, group, mode) == PIPELINE:
        mode = PIPELINE  # tensor parallelism cannot split it: pipeline stages instead
        with local_work():
            model, config = lazy_model()
    head_here = with_head and (mode == TENSOR or group.rank() == 0)
    with local_work():
        if hub is not None:  # the weights of this rank's part, then the model built on them
            stage = None
            if mode == PIPELINE:
                inner = backbone_parts(model, config).decoder
                inner.pipeline(group)
                stage = (inner.start_idx, inner.end_idx)
            hub.download(_rank_files(path, config, stage, head_here))
            model, config = lazy_model()
            if mode == TENSOR:
                place(model, config, group, mode)
        if mode == PIPELINE:
            place(model, config, group, mode)
        mx.eval(model.parameters())
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
        head = head_weights = None
        if head_here:
            loaded = load_head(path, config)
            if loaded is not None:
                head, head_weights = loaded
    lockstep = Lockstep(group, head_on_root_only=mode == PIPELINE, sharding=mode)
    # Whether rank 0 has a head, on every rank; also the barrier after loading.
    head_on_root = bool(lockstep.share_int(int(head is not None)))
    return assemble(
        path, model, tokenizer, config, head, head_weights, hidden, lockstep,
        head_elsewhere=head is None and head_on_root,
    )  # fmt: skip
