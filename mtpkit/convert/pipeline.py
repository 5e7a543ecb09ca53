"""`mtpkit convert`: any MTP checkpoint to a directory stock mlx-lm loads, with its head kept.

Data flows one way, a module per stage: source -> headers (`inspect.read_checkpoint`) ->
`plan` (which tensors, from where, to what) -> tensors streamed shard by shard by `reader`
through the family's renames and the rules of `transform` -> cast/quantize (`quant`) ->
`writer` -> `manifest` and config.json. Tensors are lazy MLX arrays until the writer
evaluates them one group at a time, so memory stays flat whatever the model's size.

The backbone comes out as `mlx_lm.convert` writes it (same names, same quantization choices,
same dtype rules); the head goes to `mtp/weights.safetensors` (names in MTP_FORMATS.md and
README), and every decision is recorded in `mtp/manifest.json`. This module holds only the
two entry points, `convert` and `graft`, and the settings they resolve.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.checkpoint.drafters import block_drafter
from mtpkit.checkpoint.inspect import Checkpoint, read_checkpoint
from mtpkit.checkpoint.links import checked_side_file
from mtpkit.checkpoint.validate import nonfinite_tensors
from mtpkit.convert.destination import (
    claim_output,
    exclusive_output,
    local_source_dir,
    new_directory,
    refuse_overlap,
)
from mtpkit.convert.draft_vocab import check_size, write_draft_vocab
from mtpkit.convert.drafter import convert_drafter
from mtpkit.convert.plan import Converter, Plan, Settings, check_conv1d, refuse_problems
from mtpkit.convert.recipes import load_recipe, recipe_note
from mtpkit.convert.records import build_manifest, drafter_record, output_config
from mtpkit.convert.rules import job_computer
from mtpkit.convert.writer import (
    shard_jobs,
    shard_name,
    tensor_meta,
    write_config,
    write_index,
    write_job_files,
)
from mtpkit.core.console import progress_bar
from mtpkit.core.errors import CheckpointProblem, MtpkitError, more_of
from mtpkit.core.manifest import HEAD_WEIGHTS_PATH, MANIFEST_PATH, write_manifest
from mtpkit.core.peers import (
    PEER_HEAD_FILE,
    declare_for_peers,
    peer_manifest_keys,
    peer_name,
    writes_peer_head,
)

# Files copied beside the weights: tokenizer, chat template, generation settings, and the
# remote code files mlx-lm copies too.
COPIED_FILES = re.compile(
    r"^(tokenizer.*|vocab.*|merges\.txt|special_tokens_map\.json|added_tokens\.json"
    r"|chat_template.*|generation_config\.json|preprocessor_config\.json"
    r"|processor_config\.json|.*\.tiktoken|tiktoken\.model|.*\.py)$"
)
# MLX's buffer cache during a conversion (its default is the whole memory limit).
BUFFER_CACHE_BYTES = 1 << 30


@dataclass
class ConvertResult:
    """What a conversion wrote (also the `--json` output of the command)."""

    output: Path
    family: str
    manifest: dict[str, Any]
    backbone_tensors: int
    head_tensors: int
    seconds: float
    # What was repaired on the way (e.g. the declared MTP layer count), for stderr.
    warnings: list[str] = field(default_factory=list)
    # The bytes of the files written (a graft: the head's files), and the backbone's bits per
    # weight as mlx-lm's `compute_bits_per_weight` counts them (None for a graft).
    written_bytes: int = 0
    bits_per_weight: float | None = None
    grafted: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "family": self.family,
            "backbone_tensors": self.backbone_tensors,
            "head_tensors": self.head_tensors,
            "bytes": self.written_bytes,
            "bits_per_weight": self.bits_per_weight,
            "seconds": round(self.seconds, 3),
            "manifest": self.manifest,
        }


# --------------------------------------------------------------------------- convert


def convert(
    source: str,
    *,
    output: str | Path,
    revision: str | None = None,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    mode: str | None = None,
    quant_predicate: str | None = None,
    keep_mtp_bf16: bool = False,
    mtp_bits: int | None = None,
    dtype: str | None = None,
    layout: str | None = None,
    hidden: str | None = None,
    recipe: str | Path | None = None,
    draft_vocab: int | None = None,
    draft_vocab_corpus: Sequence[str] = (),
    force: bool = False,
    quiet: bool = True,
) -> ConvertResult:
    """Convert `source` (local dir or Hub repo) into an MLX directory at `output`.

    The backbone is quantized as `mlx_lm.convert -q` quantizes it when `quantize` is set or
    any of `bits`, a `mode` other than affine, or a `quant_predicate` is given (the same
    defaults per mode). Flags override the recipe's settings. `draft_vocab` N: the head
    drafts over N token ids (`mtpkit.convert.draft_vocab`), the most frequent of the
    `draft_vocab_corpus` files. The directory is written into a temporary sibling and renamed
    at the end, so an interrupted run leaves no `output`.
    """
    started = time.perf_counter()
    flags = ConvertFlags(
        quantize=quantize, bits=bits, group_size=group_size, mode=mode,
        quant_predicate=quant_predicate, keep_mtp_bf16=keep_mtp_bf16, mtp_bits=mtp_bits,
        dtype=dtype, layout=layout, hidden=hidden, draft_vocab=draft_vocab,
        draft_vocab_corpus=tuple(draft_vocab_corpus),
    )  # fmt: skip
    settings, recipe_family = resolve_settings(recipe, flags)
    notes = [] if recipe is None else [recipe_note(load_recipe(recipe), source)]
    out = Path(output).expanduser()
    # Locked from the first check to the final rename: a second run writing the same output
    # is refused at once, and the rename judges `out` again (`new_directory`).
    with exclusive_output(out):
        claim_output(out, force=force, sources=[local_source_dir(source)])
        found = block_drafter(source, revision)
        if found is not None:  # a block drafter: a model of its own, not mlx-lm's
            kind, drafter = found
            refuse_overlap(out, drafter)
            record = convert_drafter(kind, drafter, out, settings, force=force)
            return ConvertResult(out, kind, record, 0, record["tensors"],
                                 time.perf_counter() - started, [n for n in notes if n],
                                 written_bytes=directory_bytes(out))  # fmt: skip
        ckpt = read_checkpoint(source, revision=revision)
        if ckpt.source.kind == "local":  # also a Hub repo's cached snapshot, used offline
            refuse_overlap(out, ckpt.source.snapshot_dir())
        _check_convertible(ckpt, settings, out, recipe, recipe_family)
        plan, manifest, layers = _convert_into(out, ckpt, settings, force=force, quiet=quiet)
    return ConvertResult(
        out,
        ckpt.family.name,
        manifest,
        len(plan.backbone),
        len(plan.head),
        time.perf_counter() - started,
        [n for n in notes if n] + repaired(ckpt, layers) + layout_warnings(settings),
        written_bytes=directory_bytes(out),
        bits_per_weight=bits_per_weight(plan),
    )


def directory_bytes(directory: Path) -> int:
    """The size of every file under `directory` (links not followed)."""
    return sum(p.lstat().st_size for p in directory.rglob("*") if p.is_file())


def bits_per_weight(plan: Plan) -> float | None:
    """The backbone's bits per weight as `mlx_lm.utils.compute_bits_per_weight` counts them
    on the loaded model: every stored byte over the parameters of its leaf modules, packed
    weights counted unpacked (`quant.count_parameters`)."""
    if not plan.total_parameters:
        return None
    stored = sum(job.nbytes for job in plan.backbone_jobs)
    return stored * 8 / plan.total_parameters


def _convert_into(
    out: Path, ckpt: Checkpoint, settings: Settings, *, force: bool, quiet: bool
) -> tuple[Plan, dict[str, Any], int]:
    """Plan and write the conversion of `ckpt` to `out`: (plan, manifest, head layers)."""
    converter = Converter(ckpt, settings)
    # MLX keeps freed buffers for reuse (much faster than fresh pages); a bound keeps tensors
    # of ever-new sizes from piling up there.
    cache_limit = mx.set_cache_limit(BUFFER_CACHE_BYTES)
    try:
        plan = converter.plan()
        layers = plan.head_layers(ckpt.family)
        config = output_config(ckpt, plan, settings, layers)
        backbone_quant = settings.backbone_record() or source_quantization(ckpt)
        manifest = build_manifest(ckpt, plan, settings, layers, backbone_quant=backbone_quant)
        if ckpt.family.standalone:
            manifest["drafter"] = drafter_record(ckpt, plan)
        declare_head(ckpt, plan, config, manifest)
        with new_directory(out, force=force) as tmp:
            _write_output(tmp, ckpt, converter, plan, config, manifest, quiet=quiet)
            refuse_nonfinite_head(tmp / HEAD_WEIGHTS_PATH, ckpt, settings.dtype)
            if settings.draft_vocab is not None:
                manifest["draft_vocab"] = write_draft_vocab(
                    tmp, settings.draft_vocab, settings.draft_vocab_corpus, vocab_size(config)
                )
                write_manifest(tmp / MANIFEST_PATH, manifest)
    finally:
        mx.set_cache_limit(cache_limit)
        converter.close()
    return plan, manifest, layers


def refuse_nonfinite_head(head_file: Path, ckpt: Checkpoint, dtype: str | None = None) -> None:
    """A head with NaN or Inf is never published as a conversion (`head_not_finite`). Inf
    from a cast to `--dtype float16` of a wider head is named as such: values past float16's
    range, not a damaged download."""
    if not head_file.exists():
        return
    bad = list(nonfinite_tensors({head_file: None}))
    if not bad:
        return
    more = more_of(bad)
    if dtype == "float16" and _overflowed(head_file, bad, ckpt):
        raise CheckpointProblem(
            f"{ckpt.source.describe()} cannot be converted to float16: the MTP head's "
            f"{bad[0]}{more} holds values past float16's range (65504); pass --dtype bfloat16 "
            "or --dtype float32"
        )
    raise CheckpointProblem(
        f"{ckpt.source.describe()} cannot be converted (head_not_finite): the MTP head's "
        f"{bad[0]}{more} holds NaN or Inf; download the checkpoint again or take the head "
        "from the original"
    )


def _overflowed(head_file: Path, bad: list[str], ckpt: Checkpoint) -> bool:
    """Only Inf (a cast overflows to Inf, never to NaN) from a head stored wider than F16."""
    if all(t.dtype == "F16" for t in ckpt.mtp_tensors):
        return False
    tensors = mx.load(str(head_file), format="safetensors")
    return not any(mx.any(mx.isnan(tensors[name])).item() for name in bad)


# Why `--layout inline` is not the default (MTP_FORMATS.md "What the MLX runtimes read").
INLINE_WARNING = (
    "--layout inline: mlx-lm < 0.32 (pinned by vllm-mlx 0.6, MTPLX 2.12 and Rapid-MLX 0.16) adds "
    "+1 to every backbone norm of a Qwen3.5 model whose shards hold mtp.* tensors, so those "
    "runtimes run a corrupted backbone; the default sidecar layout runs in all of them"
)


def layout_warnings(settings: Settings) -> list[str]:
    return [INLINE_WARNING] if settings.layout == "inline" else []


def declare_head(
    ckpt: Checkpoint, plan: Plan, config: dict[str, Any], manifest: dict[str, Any]
) -> None:
    """Declare the head where the MLX runtimes read it (`mtpkit.core.peers`): config.json keys
    (in place, `auto_map` dropped) and the manifest's keys beside mtpkit's own."""
    family = ckpt.family
    dropped = declare_for_peers(
        config,
        family_name=family.name,
        head_prefix=family.head_prefix,
        head_quant=plan.head_quant,
        hidden=manifest.get("hidden") if plan.head else None,
    )
    earlier = (ckpt.manifest or {}).get("config_dropped")
    if isinstance(earlier, dict):  # converting mtpkit's own output: keep the first record
        dropped = {**earlier, **dropped}
    manifest.update(peer_manifest_keys(family.name, dropped))


def peer_head_file(directory: Path, ckpt: Checkpoint) -> tuple[Path, Callable[[str], str]] | None:
    """`mtp.safetensors` in `directory` and its key names, for the families the peers run."""
    family = ckpt.family
    if not writes_peer_head(family.name):
        return None
    return directory / PEER_HEAD_FILE, lambda name: peer_name(name, family.head_prefix)


def repaired(ckpt: Checkpoint, layers: int) -> list[str]:
    """Warnings for the problems convert repairs rather than refuses (TOLERATED_PROBLEMS)."""
    return [
        f"{p['message'].split(': set ')[0]}; writing {ckpt.family.mtp_field()}={layers}"
        for p in ckpt.problems
        if p["code"] in ("mtp_layer_count_mismatch", "mtp_present_not_declared")
    ]


def _check_convertible(
    ckpt: Checkpoint,
    settings: Settings,
    out: Path,
    recipe: str | Path | None,
    recipe_family: str | None,
) -> None:
    """Refuse what cannot be converted safely, before anything is read or written."""
    refuse_problems(ckpt)
    if recipe_family is not None and recipe_family != ckpt.family.name:
        raise MtpkitError(
            f"recipe {recipe} is for {recipe_family} models but {ckpt.source.describe()} is "
            f"{ckpt.family.name}: pick the recipe of this model"
        )
    if settings.layout == "inline" and not ckpt.family.inline_layout:
        raise MtpkitError(
            f"--layout inline exists only for the Qwen3.5/3.6 families, not {ckpt.family.name}"
        )
    source_quant = ckpt.config.get("quantization")
    requested = settings.quantizes_backbone or settings.mtp_bits or settings.keep_mtp_bf16
    if source_quant is not None and requested:
        origin = ((ckpt.manifest or {}).get("source") or {}).get("spec")
        hint = f" ({origin})" if origin else ""
        raise MtpkitError(
            f"{ckpt.source.describe()} is already quantized ({source_quant.get('bits')}-bit): "
            f"quantizing it again would compound the error; convert from the original "
            f"checkpoint{hint} instead"
        )
    check_conv1d(ckpt)
    side_files(ckpt)
    if settings.draft_vocab is not None:
        if ckpt.family.standalone or not ckpt.mtp_tensors:
            raise MtpkitError(
                f"--draft-vocab subsets the MTP head's lm_head, and {ckpt.source.describe()} "
                "has no MTP head"
            )
        check_size(settings.draft_vocab, vocab_size(ckpt.config))


def vocab_size(config: dict[str, Any]) -> int:
    """The width of the model's logits (the lm_head's rows)."""
    text = config.get("text_config") or config
    return int(text.get("vocab_size") or config.get("vocab_size") or 0)


def source_quantization(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The backbone's {bits, group_size, mode} for the manifest, kept from the source."""
    source_quant = ckpt.config.get("quantization")
    if not isinstance(source_quant, dict):
        return None
    return {
        "bits": source_quant.get("bits"),
        "group_size": source_quant.get("group_size"),
        "mode": source_quant.get("mode", "affine"),
    }


def _write_output(
    tmp: Path,
    ckpt: Checkpoint,
    converter: Converter,
    plan: Plan,
    config: dict[str, Any],
    manifest: dict[str, Any],
    *,
    quiet: bool,
) -> None:
    """Every file of the conversion into the directory `tmp`."""
    inline = converter.settings.layout == "inline"
    model_jobs = plan.backbone_jobs + (plan.head_jobs if inline else [])
    shards = shard_jobs(model_jobs)
    files = [(tmp / shard_name(i, len(shards)), jobs) for i, jobs in enumerate(shards)]
    weight_map = {n: path.name for path, jobs in files for job in jobs for n in job.entry_names}
    total_size = sum(job.nbytes for job in model_jobs)
    renames = {}
    if plan.head_jobs:
        files.append((tmp / HEAD_WEIGHTS_PATH, plan.head_jobs))
        if (peer := peer_head_file(tmp, ckpt)) is not None:
            files.append((peer[0], plan.head_jobs))
            renames[peer[0]] = peer[1]
    # Each job is computed once, however many files hold it (inline: shards and mtp/).
    unique = {id(job): job for _, jobs in files for job in jobs}
    bar = progress_bar(sum(job.nbytes for job in unique.values()), desc="convert", quiet=quiet)
    meta = tensor_meta(plan.backbone + plan.head)
    write_job_files(files, job_computer(), meta, bar.update if bar is not None else None, renames)
    write_index(tmp / "model.safetensors.index.json", weight_map, total_size, plan.total_parameters)
    if plan.head_jobs or ckpt.family.standalone:
        (tmp / MANIFEST_PATH).parent.mkdir(exist_ok=True)
        write_manifest(tmp / MANIFEST_PATH, manifest)
    if bar is not None:
        bar.close()
    write_config(tmp / "config.json", config)
    _copy_side_files(ckpt, tmp)


def _copy_side_files(ckpt: Checkpoint, out: Path) -> None:
    """The tokenizer and the other side files, each checked first (`checkpoint.links`): no
    link out of the source is followed, and a file is what its name says."""
    for name, path in side_files(ckpt):
        shutil.copyfile(path, out / name)


def side_files(ckpt: Checkpoint) -> list[tuple[str, Path]]:
    """(name, checked path) of each side file to copy; `convert` checks them before any
    weight is written, then again as it copies them."""
    found = []
    for name in sorted(ckpt.source.files):
        if "/" not in name and COPIED_FILES.match(name):
            path = ckpt.source.local_file(name)
            found.append((name, checked_side_file(path.parent, path.name)))
    return found


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ConvertFlags:
    """The settings flags of one conversion as given (None or False: not given)."""

    quantize: bool = False
    bits: int | None = None
    group_size: int | None = None
    mode: str | None = None
    quant_predicate: str | None = None
    keep_mtp_bf16: bool = False
    mtp_bits: int | None = None
    dtype: str | None = None
    layout: str | None = None
    hidden: str | None = None
    draft_vocab: int | None = None
    draft_vocab_corpus: tuple[str, ...] = ()

    def given(self) -> dict[str, Any]:
        """The flags that were given, by `Settings` field name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if v is not None and v is not False}


def resolve_settings(
    recipe: str | Path | None, flags: ConvertFlags = ConvertFlags()
) -> tuple[Settings, str | None]:
    """Defaults, then the recipe's values, then every flag that was given.

    Returns the settings and the family the recipe is meant for (None without a recipe).
    """
    values: dict[str, Any] = {}
    family = None
    if recipe is not None:
        loaded = load_recipe(recipe)
        values.update(loaded.settings)
        family = loaded.family
    if flags.keep_mtp_bf16 and flags.mtp_bits is not None:
        raise MtpkitError("--keep-mtp-bf16 and --mtp-bits contradict each other: pass one")
    # A head flag replaces the recipe's head choice, whichever it was.
    if flags.mtp_bits is not None:
        values.pop("keep_mtp_bf16", None)
    if flags.keep_mtp_bf16:
        values.pop("mtp_bits", None)
    values.update(flags.given())
    if values.get("group_size") is None:
        values.pop("group_size", None)
    values["hidden_given"] = "hidden" in values
    settings = Settings(**values)
    settings.validate()
    return settings, family


__all__ = ["ConvertFlags", "ConvertResult", "Settings", "convert", "resolve_settings"]
