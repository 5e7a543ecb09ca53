"""`mtpkit inspect`: what a checkpoint holds, from its JSON files and safetensors headers.

Only `config.json`, the index, the manifest and each shard's header are read; on the Hub
that is a ranged read of a few kilobytes per shard. Problems are reported, never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtpkit.checkpoint.headers import HeaderError, ShardHeader, TensorInfo, parse_header
from mtpkit.checkpoint.source import Source, is_safe_relpath, no_config, open_source
from mtpkit.checkpoint.validate import (
    config_problems,
    layer_count_problem,
    mtp_field_valid,
    present_layers,
    quantization_problem,
    tokenizer_problem,
)
from mtpkit.core.config import require_config_object
from mtpkit.core.errors import NotACheckpoint
from mtpkit.core.manifest import MANIFEST_PATH, SIDECAR_WEIGHTS, norm_convention
from mtpkit.families import Family, family_for
from mtpkit.families.base import incomplete_experts

INDEX_PATH = "model.safetensors.index.json"

# Stable problem codes (documented in README.md).
PROBLEM_CODES = {
    "mtp_declared_not_present": "the config declares MTP layers but no MTP tensors exist",
    "mtp_present_not_declared": "MTP tensors exist but the config does not declare them",
    "incomplete_experts": "the MTP head's experts do not cover every expert and projection",
    "incomplete_mtp": "the MTP head lacks a tensor every head of its family has",
    "missing_shard": "the index names a shard file the checkpoint lacks",
    "missing_tensor": "the index names a tensor its shard does not hold",
    "corrupt_header": "a shard's safetensors header is invalid for its file",
    "unsafe_path": "the index names a file outside the checkpoint; it was not opened",
    "total_size_mismatch": "the index's metadata.total_size differs from the tensors' bytes",
    "missing_model_type": "config.json has no top-level model_type (loaders need it)",
    "invalid_config": "a config.json value has the wrong type or is out of range",
    "mtp_layer_count_mismatch": "the declared MTP layer count differs from the layers present",
    "tokenizer_exceeds_vocab": "the tokenizer has ids past the model's vocab_size",
    "missing_token_ordering": "a Gemma 4 assistant with ordered embeddings lacks token_ordering",
    "assistant_unpairable": "a Gemma 4 assistant's projections fit no target's hidden size",
}
# Problems that mean the head cannot be used as it is (`--require-mtp` exits 3 on these).
HEAD_UNUSABLE = {
    "mtp_declared_not_present",
    "incomplete_experts",
    "incomplete_mtp",
    "missing_token_ordering",
    "assistant_unpairable",
}
# Problems that leave some tensors unread: what they hold is unknown, not absent.
UNREADABLE = {"missing_shard", "corrupt_header", "unsafe_path"}


@dataclass
class Checkpoint:
    """A source with its config, family and every readable tensor header."""

    source: Source
    config: dict[str, Any]
    family: Family
    format: str
    manifest: dict[str, Any] | None
    index: dict[str, Any] | None
    shards: list[str]
    sidecars: list[str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    headers: dict[str, ShardHeader] = field(default_factory=dict)
    problems: list[dict[str, str]] = field(default_factory=list)
    # Copies of the head for other runtimes, named by the manifest (not read as a head).
    peer_files: list[str] = field(default_factory=list)

    def problem(self, code: str, message: str) -> None:
        self.problems.append({"code": code, "message": message})

    @property
    def mtp_tensors(self) -> list[TensorInfo]:
        return [
            t
            for t in self.tensors.values()
            if t.shard in self.sidecars or self.family.is_mtp_tensor(t.name)
        ]


def read_checkpoint(spec: str, *, revision: str | None = None) -> Checkpoint:
    """Open a source and read its config, index, manifest and shard headers."""
    source = open_source(spec, revision=revision)
    config = _read_config(source)
    drafter = drafter_base_type(config)
    family = family_for({**config, "model_type": drafter} if drafter else config)
    manifest = source.read_json(MANIFEST_PATH) if source.has(MANIFEST_PATH) else None
    index = source.read_json(INDEX_PATH) if source.has(INDEX_PATH) else None
    weight_map, shards, peer_files, sidecars = _weight_files(source, manifest, index)
    if drafter or family.standalone:  # every tensor of a standalone drafter is the head's
        shards, sidecars = [], shards + sidecars
    ckpt = Checkpoint(source, config, family, "hf", manifest, index, shards, sidecars)
    ckpt.peer_files = peer_files
    for p in config_problems(config, family.mtp_field()):
        ckpt.problem(p.code, p.message)
    mismatch = tokenizer_problem(config, _local_tokenizer(source), source.describe())
    if mismatch is not None:
        ckpt.problem(mismatch.code, mismatch.message)
    copies = _read_headers(ckpt, shards + sidecars)
    unquantized = quantization_problem(config, ckpt.tensors)
    if unquantized is not None:
        ckpt.problem(unquantized.code, unquantized.message)
    _follow_index(ckpt, copies, weight_map)
    _check_index(ckpt, weight_map)
    ckpt.format = MLX_VLM_DRAFTER if drafter else _format(ckpt)
    if not isinstance(config.get("model_type"), str):
        ckpt.problem(
            "missing_model_type",
            f"config.json in {source.describe()} has no top-level model_type (mlx-lm and "
            f'transformers pick the model class by it): add "model_type": '
            f'"{family.name}" or convert from the original repo',
        )
    if family.standalone:  # a model of its own (Gemma 4's assistant): the family checks it
        if not unread_mtp_shards(ckpt):
            shapes = {t.name: t.shape for t in ckpt.tensors.values()}
            for code, message in family.checkpoint_problems(shapes):
                ckpt.problem(code, message)
    elif not drafter:  # a drafter's head is mlx-vlm's module tree, not the family's names
        _check_mtp(ckpt)
    return ckpt


def _local_tokenizer(source: Source) -> Any:
    """A local source's tokenizer.json (a Hub repo's is checked where generate downloads it,
    rather than fetched here for a header-only inspect); None when absent or unreadable."""
    if source.kind != "local" or not source.has("tokenizer.json"):
        return None
    try:
        return source.read_json("tokenizer.json")
    except NotACheckpoint:  # not JSON: the tokenizer's own loader names that
        return None


def _read_config(source: Source) -> dict[str, Any]:
    if not source.has("config.json"):
        raise no_config(source)
    config = source.read_json("config.json")
    if not isinstance(config, dict):
        raise NotACheckpoint(f"config.json in {source.describe()} is not a JSON object")
    return require_config_object(config, source.describe())


def _weight_files(
    source: Source, manifest: Any, index: Any
) -> tuple[dict[str, Any], list[str], list[str], list[str]]:
    """(the index's weight map, the shards, the peers' copies of an mtpkit head, the sidecars)."""
    if index is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise NotACheckpoint(f"{INDEX_PATH} in {source.describe()} has no weight_map object")
        shards = sorted(set(map(str, weight_map.values())))
    else:
        weight_map = {}
        shards = sorted(n for n in source.files if "/" not in n and n.endswith(".safetensors"))
    # Files an mtpkit manifest names as copies of its head for other runtimes
    # (`mtpkit.core.peers`): the same tensors again, not a second head.
    peer_files = sorted(
        n
        for n in ((manifest or {}).get("peer_files") or {} if isinstance(manifest, dict) else {})
        if isinstance(n, str) and source.has(n) and n not in shards
    )
    sidecars = [
        n for n in SIDECAR_WEIGHTS if source.has(n) and n not in shards and n not in peer_files
    ]
    if not shards and not sidecars:
        raise NotACheckpoint(f"{source.describe()} has config.json but no safetensors weights")
    return weight_map, shards, peer_files, sidecars


def _read_headers(ckpt: Checkpoint, files: list[str]) -> dict[str, list[str]]:
    """Every file's header into `ckpt`; returns the tensors more than one shard holds."""
    source = ckpt.source
    copies: dict[str, list[str]] = {}
    for shard in files:
        if not is_safe_relpath(shard):
            ckpt.problem(
                "unsafe_path", f"index names {shard!r}, outside the checkpoint; not opened"
            )
            continue
        if not source.has(shard):
            ckpt.problem(
                "missing_shard", f"index names {shard} but the checkpoint has no such file"
            )
            continue
        try:
            header = parse_header(
                shard, source.files[shard], lambda a, n, s=shard: source.read_bytes_range(s, a, n)
            )
        except HeaderError as e:
            ckpt.problem("corrupt_header", str(e))
            continue
        ckpt.headers[shard] = header
        for name, info in header.tensors.items():
            if shard in ckpt.shards and name in ckpt.tensors:
                copies.setdefault(name, [ckpt.tensors[name].shard]).append(shard)
            ckpt.tensors.setdefault(name, info)
    return copies


def _check_index(ckpt: Checkpoint, weight_map: dict[str, Any]) -> None:
    """The index against the headers: every mapped tensor held, `total_size` the bytes read."""
    for name, shard in sorted(weight_map.items()):
        if shard in ckpt.headers and name not in ckpt.headers[shard].tensors:
            ckpt.problem("missing_tensor", f"index maps {name} to {shard}, which does not hold it")
    if ckpt.index is None:
        return
    declared = (ckpt.index.get("metadata") or {}).get("total_size")
    # A standalone drafter's shards are all its head's (`sidecars`); the index covers them.
    shards = ckpt.shards or ckpt.sidecars
    if declared is None or not all(s in ckpt.headers for s in shards):
        return
    actual = sum(
        t.nbytes for h in ckpt.headers.values() if h.shard in shards for t in h.tensors.values()
    )
    if int(declared) != actual:
        ckpt.problem(
            "total_size_mismatch",
            f"index metadata.total_size is {declared} but the shards hold {actual} tensor bytes",
        )


def _follow_index(ckpt: Checkpoint, copies: dict[str, list[str]], weight_map: dict) -> None:
    """A tensor stored in several shards is read from the shard the index names, and the
    copies are a problem (`duplicate_tensor`): which one the writer meant is not certain."""
    if not copies:
        return
    for name in copies:
        indexed = weight_map.get(name)
        if indexed in ckpt.headers and name in ckpt.headers[indexed].tensors:
            ckpt.tensors[name] = ckpt.headers[indexed].tensors[name]
    name, holders = next(iter(sorted(copies.items())))
    more = f" (+{len(copies) - 1} more tensors)" if len(copies) > 1 else ""
    chosen = weight_map.get(name)
    rule = f"the index names {chosen}" if chosen else "no index says which is meant"
    ckpt.problem(
        "duplicate_tensor",
        f"{name} is stored in {' and '.join(holders)}{more}; {rule}: remove the extra "
        "copies (or download the checkpoint again)",
    )


# The `format` of a standalone mlx-vlm MTP drafter (`python -m mlx_vlm.split_mtp`, or a
# published "-drafter" repo): config model_type `<base>_mtp`, the base model's text_config,
# and the head alone under mlx-vlm's names (`fc.weight`, `layers.0...`).
MLX_VLM_DRAFTER = "mlx-vlm-drafter"
DRAFTER_TYPES = {"qwen3_5_mtp"}


def drafter_base_type(config: dict[str, Any]) -> str | None:
    """The base model_type of a standalone mlx-vlm drafter's config, None for any other."""
    text = config.get("text_config")
    if config.get("model_type") not in DRAFTER_TYPES or not isinstance(text, dict):
        return None
    base = text.get("model_type")
    return base if isinstance(base, str) else None


def _format(ckpt: Checkpoint) -> str:
    """`mlx` for a directory written by mlx-lm or mtpkit, else `hf`."""
    if ckpt.manifest is not None or "quantization" in ckpt.config:
        return "mlx"
    formats = {h.metadata.get("format") for h in ckpt.headers.values() if h.shard in ckpt.shards}
    return "mlx" if "mlx" in formats else "hf"


def unread_mtp_shards(ckpt: Checkpoint) -> list[str]:
    """Shards that could not be read and may hold MTP tensors (per the index; without an
    index, any unread shard may)."""
    weight_map = (ckpt.index or {}).get("weight_map") or {}
    unread = [s for s in ckpt.shards + ckpt.sidecars if s not in ckpt.headers]
    if not weight_map:
        return unread
    holding = {s for n, s in weight_map.items() if ckpt.family.is_mtp_tensor(n)}
    return [s for s in unread if s in holding or s in ckpt.sidecars]


def _check_mtp(ckpt: Checkpoint) -> None:
    family = ckpt.family
    mtp = ckpt.mtp_tensors
    declared = family.declared_mtp_layers()
    where = ckpt.source.describe()
    if not mtp_field_valid(ckpt.config, family.mtp_field()):
        return  # `invalid_config` names it; nothing is declared to compare
    if unread_mtp_shards(ckpt):
        return  # a damaged or missing shard: its problem says so; the head is unknown
    names = [family.head_relative(t.name) or "" for t in mtp if family.duplicate_of(t.name) is None]
    present = family.config_mtp_layers(present_layers(names))
    if mismatch := layer_count_problem(family.mtp_field(), declared, present):
        ckpt.problem(mismatch.code, mismatch.message)
    if declared and not mtp:
        ckpt.problem(
            "mtp_declared_not_present",
            f"config declares {family.mtp_field()}={declared} but no MTP tensors exist in "
            f"{where}; it was converted without its MTP head: convert from the original "
            "repo, or graft the head with `mtpkit convert ORIGINAL --mtp-only --into DIR`",
        )
    if mtp and not declared and family.declared_upstream:
        ckpt.problem(
            "mtp_present_not_declared",
            f"{len(mtp)} MTP tensors exist but the config does not declare {family.mtp_field()}",
        )
    if not mtp:
        return
    shapes = {t.name: t.shape for t in mtp}
    for message in incomplete_experts(shapes, family.num_experts, family.expert_projections):
        ckpt.problem("incomplete_experts", message)
    if not ckpt.sidecars or ckpt.manifest is not None:
        missing = family.missing_mtp_tensors(t.name for t in mtp)
        if missing:
            ckpt.problem(
                "incomplete_mtp",
                f"the MTP head lacks {len(missing)} required tensors (first: {missing[0]})",
            )


def mtp_norm_convention(ckpt: Checkpoint) -> str:
    """Recorded facts only: the manifest, or the definition of a raw HF checkpoint."""
    recorded = norm_convention(ckpt.manifest)
    if recorded:
        return recorded
    if not ckpt.family.zero_centred_norms:
        return "plain"
    if ckpt.format == "hf":
        return "zero_centred"
    return "unknown"
