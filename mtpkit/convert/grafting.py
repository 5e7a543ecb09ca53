"""Grafting a head: `mtpkit convert --mtp-only --into DIR` adds the MTP head of a checkpoint to an
existing MLX conversion of the same model, reading only the head's tensors (on the Hub: their
byte ranges), quantized like the trunk, and moved into place file by file through
`destination.FileSwap` (a failure leaves DIR as it was)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.checkpoint.inspect import Checkpoint, read_checkpoint
from mtpkit.convert.destination import (
    FileSwap,
    local_source_dir,
    refuse_overlap,
    remove_stale,
)
from mtpkit.convert.pipeline import (
    BUFFER_CACHE_BYTES,
    ConvertResult,
    declare_head,
    peer_head_file,
    refuse_nonfinite_head,
    source_quantization,
)
from mtpkit.convert.plan import Converter, Plan, Settings, refuse_problems
from mtpkit.convert.records import build_manifest, set_quantization
from mtpkit.convert.rules import job_computer
from mtpkit.convert.writer import (
    read_config,
    tensor_meta,
    write_config,
    write_job_files,
)
from mtpkit.core.console import progress_bar
from mtpkit.core.errors import MtpkitError
from mtpkit.core.manifest import HEAD_WEIGHTS_PATH, MANIFEST_PATH, write_manifest

TRUNK_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers")


def graft(
    source: str,
    *,
    into: str | Path,
    revision: str | None = None,
    keep_mtp_bf16: bool = False,
    mtp_bits: int | None = None,
    group_size: int | None = None,
    dtype: str | None = None,
    hidden: str | None = None,
    force: bool = False,
    quiet: bool = True,
) -> ConvertResult:
    """Add the MTP head of `source` to the existing MLX conversion `into`.

    Only the head's tensors are read (on the Hub: their byte ranges). The trunk must be the
    same model (model_type, hidden size, vocab size, layer count); its quantization is kept
    and the head is quantized like it unless a head flag says otherwise. A head `into`
    already has is replaced only with `force`.
    """
    started = time.perf_counter()
    into = Path(into).expanduser()
    if not (into / "config.json").is_file():
        raise MtpkitError(f"--into {into} is not an MLX model directory (no config.json)")
    refuse_overlap(into, local_source_dir(source), option="--into")
    FileSwap(into).check(graft_targets(into))
    trunk = read_checkpoint(str(into))
    if trunk.format != "mlx":
        raise MtpkitError(f"--into {into} is not an MLX conversion; run `mtpkit convert` instead")
    if trunk.mtp_tensors and not force:
        where = ", ".join(sorted({t.shard for t in trunk.mtp_tensors}))
        raise MtpkitError(
            f"--into {into} already has an MTP head ({len(trunk.mtp_tensors)} tensors in "
            f"{where}): pass --force to replace it"
        )
    ckpt = read_checkpoint(source, revision=revision)
    _check_graftable(ckpt, trunk, into)
    trunk_quant = trunk.config.get("quantization")
    trunk_mode = (trunk_quant or {}).get("mode") or "affine"
    settings = Settings(
        bits=trunk_quant.get("bits") if trunk_quant else None,
        group_size=group_size or (trunk_quant or {}).get("group_size"),
        mode=trunk_mode,
        keep_mtp_bf16=keep_mtp_bf16,
        mtp_bits=mtp_bits,
        dtype=dtype or _trunk_dtype(trunk),
        hidden=hidden or "post_norm",
        hidden_given=hidden is not None,
    )
    settings.validate()
    converter = Converter(ckpt, settings, head_only=True)
    cache_limit = mx.set_cache_limit(BUFFER_CACHE_BYTES)
    try:
        plan = converter.plan()
        plan.backbone_dtype = None
        layers = plan.head_layers(ckpt.family)
        config = read_config(into / "config.json")
        set_quantization(config, config.get("quantization"), ckpt.family, plan, settings)
        ckpt.family.declare_mtp(config, layers)
        backbone_quant = source_quantization(trunk)
        manifest = build_manifest(ckpt, plan, settings, layers, backbone_quant=backbone_quant)
        manifest["grafted_into"] = str(into)
        declare_head(ckpt, plan, config, manifest)
        _write_graft(into, ckpt, converter, plan, config, manifest, quiet=quiet)
    finally:
        mx.set_cache_limit(cache_limit)
        converter.close()
    seconds = time.perf_counter() - started
    # The head's files (the peers' `mtp.safetensors` too, where the family writes one).
    written = sum(p.stat().st_size for p in graft_targets(into)[:2] if p.is_file())
    if (peer := peer_head_file(into, ckpt)) is not None and peer[0].is_file():
        written += peer[0].stat().st_size
    return ConvertResult(
        into, ckpt.family.name, manifest, 0, len(plan.head), seconds,
        written_bytes=written, grafted=True,
    )  # fmt: skip


def _check_graftable(ckpt: Checkpoint, trunk: Checkpoint, into: Path) -> None:
    """The source must have a head, and the trunk must be the source's model."""
    refuse_problems(ckpt)
    if not ckpt.mtp_tensors:
        raise MtpkitError(f"{ckpt.source.describe()} has no MTP head to graft")
    mismatches = []
    if trunk.family.name != ckpt.family.name:
        mismatches.append(
            f"model_type {trunk.config.get('model_type')} vs {ckpt.config.get('model_type')}"
        )
    for key in TRUNK_FIELDS:
        a, b = trunk.family.text_config.get(key), ckpt.family.text_config.get(key)
        if a != b:
            mismatches.append(f"{key} {a} vs {b}")
    if mismatches:
        raise MtpkitError(
            f"the trunk in {into} is not the model of {ckpt.source.describe()}: "
            + ", ".join(mismatches)
        )


def _trunk_dtype(trunk: Checkpoint) -> str | None:
    """The float dtype the trunk stores its unquantized tensors in (its norms, scales)."""
    counts: dict[str, int] = {}
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    for t in trunk.tensors.values():
        if t.dtype in names and t.name.endswith(("norm.weight", ".scales")):
            counts[names[t.dtype]] = counts.get(names[t.dtype], 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


def graft_targets(into: Path) -> list[Path]:
    """The files a graft replaces in `into` (head, manifest, config), in writing order."""
    return [into / HEAD_WEIGHTS_PATH, into / MANIFEST_PATH, into / "config.json"]


def _write_graft(
    into: Path,
    ckpt: Checkpoint,
    converter: Converter,
    plan: Plan,
    config: dict[str, Any],
    manifest: dict[str, Any],
    *,
    quiet: bool,
) -> None:
    """Head file, manifest and config written beside their targets, then moved over them;
    a failure (a NaN/Inf head included) leaves `into` as it was (no new empty mtp/)."""
    targets = graft_targets(into)
    peer = peer_head_file(into, ckpt)
    remove_stale(targets + ([peer[0]] if peer else []))
    swap = FileSwap(into)
    try:
        bar = progress_bar(sum(a.nbytes for _, a in plan.head), desc="graft", quiet=quiet)
        on_bytes = bar.update if bar is not None else None
        tmp_weights = swap.temp_for(targets[0])
        files = [(tmp_weights, plan.head_jobs)]
        renames = {}
        if peer is not None:  # the same head under the peers' names, moved in with the rest
            files.append((swap.temp_for(peer[0]), plan.head_jobs))
            renames[files[-1][0]] = peer[1]
        write_job_files(files, job_computer(), tensor_meta(plan.head), on_bytes, renames)
        if bar is not None:
            bar.close()
        refuse_nonfinite_head(tmp_weights, ckpt, converter.settings.dtype)
        write_manifest(swap.temp_for(targets[1]), manifest)
        write_config(swap.temp_for(targets[2]), config)
        swap.commit()
    except BaseException as e:
        swap.abort()
        if isinstance(e, OSError):
            raise MtpkitError(f"grafting into {into} failed, nothing was changed: {e}") from None
        raise


__all__ = ["graft", "graft_targets"]
