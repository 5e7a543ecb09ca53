"""`mtpkit convert`: any MTP checkpoint to a directory stock mlx-lm loads, with its head kept.

Data flows one way: source -> headers (inspect's Checkpoint) -> plan -> tensors streamed shard
by shard through the family's renames and the tensor rules below -> cast/quantize -> writer ->
manifest. Tensors are lazy MLX arrays until the writer evaluates them one group at a time, so
memory stays flat whatever the model's size.

The backbone comes out as `mlx_lm.convert` writes it (same names, same quantization choices,
same dtype rules); the head goes to `mtp/weights.safetensors` (names in MTP_FORMATS.md and
README), and every decision is recorded in `mtp/manifest.json`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mtpkit import __version__
from mtpkit.errors import CheckpointProblem, MtpkitError
from mtpkit.families import Family
from mtpkit.families.base import FUSED_DOWN, FUSED_GATE_UP, PER_EXPERT, expert_layout
from mtpkit.headers import TensorInfo
from mtpkit.inspect import Checkpoint, read_checkpoint
from mtpkit.manifest import (
    HEAD_WEIGHTS_PATH,
    MANIFEST_FORMAT,
    MANIFEST_PATH,
    PLAIN,
    SHIFTED,
    UNSHIFTED,
    write_manifest,
)
from mtpkit.quant import (
    DTYPES,
    ModuleTree,
    QuantSpec,
    build_model,
    dtype_name,
    infer_spec,
    is_floating,
    model_cast_predicate,
    model_quant_predicate,
    quant_decision,
    quantize,
)
from mtpkit.writer import (
    MAX_SHARD_BYTES,
    FileLayout,
    default_workers,
    run_jobs,
    shard_name,
    write_index,
)

# Problems inspect may report that do not make a conversion unsafe: convert declares the
# head in the output config itself.
TOLERATED_PROBLEMS = {"mtp_present_not_declared"}
# Files copied beside the weights: tokenizer, chat template, generation settings, and the
# remote code files mlx-lm copies too.
COPIED_FILES = re.compile(
    r"^(tokenizer.*|vocab.*|merges\.txt|special_tokens_map\.json|added_tokens\.json"
    r"|chat_template.*|generation_config\.json|preprocessor_config\.json"
    r"|processor_config\.json|.*\.tiktoken|tiktoken\.model|.*\.py)$"
)
LAYOUTS = ("sidecar", "inline")
FP8_DTYPES = ("F8_E4M3",)
HIDDEN_VARIANTS = ("post_norm", "pre_norm")
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

    def as_dict(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "family": self.family,
            "backbone_tensors": self.backbone_tensors,
            "head_tensors": self.head_tensors,
            "seconds": round(self.seconds, 3),
            "manifest": self.manifest,
        }


# --------------------------------------------------------------------------- reading


class TensorReader:
    """Lazy tensors of a checkpoint, one shard at a time, fetching only what is needed.

    Local shards are opened with `mx.load` (lazy: a tensor is read when evaluated). On the
    Hub, a shard nearly all of whose bytes are needed is downloaded (into the HF cache, as
    mlx-lm does); otherwise only the needed tensors' byte ranges are fetched, in bounded chunks,
    into a temporary safetensors file that is then opened lazily too, so memory stays flat
    whatever the head's size. `close()` removes those files once the output is written.
    """

    # Gaps below this are read through rather than split into another request.
    COALESCE_GAP = 64 << 10
    CHUNK_BYTES = 256 << 20
    # Download a whole shard only when nearly all of it is needed: DeepSeek's duplicated
    # embedding and head copies (1.7 GB each) are then never fetched.
    DOWNLOAD_FRACTION = 0.9

    def __init__(self, ckpt: Checkpoint, needed: set[str], *, ranged: bool = False) -> None:
        self.ckpt = ckpt
        self.needed = needed
        self.ranged = ranged
        self.tmpdir: Path | None = None

    def shard(self, shard: str) -> Iterator[tuple[TensorInfo, Ref]]:
        header = self.ckpt.headers[shard]
        infos = sorted(
            (t for t in header.tensors.values() if t.name in self.needed), key=lambda t: t.start
        )
        if not infos:
            return
        source = self.ckpt.source
        needed_bytes = sum(t.nbytes for t in infos)
        if source.kind == "local" or (
            not self.ranged and needed_bytes >= self.DOWNLOAD_FRACTION * header.file_size
        ):
            path = source.local_file(shard)
        else:
            path = self._fetch_ranges(shard, infos)
        for info in infos:
            yield info, Ref(str(path), info.name)

    def _fetch_ranges(self, shard: str, infos: list[TensorInfo]) -> Path:
        """Copy the tensors' bytes into a local safetensors file holding only them."""
        import tempfile

        if self.tmpdir is None:
            self.tmpdir = Path(tempfile.mkdtemp(prefix="mtpkit-ranges-"))
        path = self.tmpdir / f"{len(list(self.tmpdir.iterdir()))}.safetensors"
        header: dict[str, Any] = {}
        offset = 0
        for info in infos:
            header[info.name] = {
                "dtype": info.dtype,
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        raw = json.dumps(header).encode("utf-8")
        raw += b" " * (-(len(raw) + 8) % 8)
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for run in _coalesce(infos, self.COALESCE_GAP):
                for start in range(run[0].start, run[-1].end, self.CHUNK_BYTES):
                    end = min(start + self.CHUNK_BYTES, run[-1].end)
                    data = self.ckpt.source.read_bytes_range(shard, start, end - start)
                    if len(data) != end - start:
                        raise MtpkitError(
                            f"{shard}: asked for {end - start} bytes at {start}, got {len(data)}"
                        )
                    for info in run:  # the parts of needed tensors inside [start, end)
                        lo, hi = max(info.start, start), min(info.end, end)
                        if lo < hi:
                            f.write(memoryview(data)[lo - start : hi - start])
                    del data
        return path

    def close(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def _load(path: str) -> dict[str, mx.array]:
    """Every tensor of a safetensors file, lazily (read when evaluated)."""
    return mx.load(path)


def _coalesce(infos: list[TensorInfo], gap: int) -> Iterator[list[TensorInfo]]:
    run: list[TensorInfo] = []
    for info in infos:
        if run and info.start - run[-1].end > gap:
            yield run
            run = []
        run.append(info)
    if run:
        yield run


# --------------------------------------------------------------------------- tensor rules


@dataclass(frozen=True)
class Ref:
    """A source tensor: a local safetensors file and the tensor's name in it."""

    path: str
    name: str


@dataclass
class Tensor:
    """One output tensor before cast/quantization: its role, name, lazy value and state."""

    role: str  # "backbone" or "head"
    name: str
    array: mx.array
    shift: bool = False


Outputs = list[tuple[str, mx.array]]


@dataclass
class Item:
    """Source tensors and how they become named outputs (computed only when called).

    Every source tensor feeds exactly one Item, so a worker can load, compute, write and
    release it on its own.
    """

    refs: list[Ref]
    names: list[str]
    fn: Callable[[list[mx.array]], Outputs]


@dataclass
class Job:
    role: str
    refs: list[Ref]
    make: Callable[[list[mx.array]], list[Tensor]]
    entry_names: list[str] = field(default_factory=list)
    nbytes: int = 0  # output bytes
    source_bytes: int = 0


def _leaf(ref: Ref, name: str) -> Item:
    return Item([ref], [name], lambda arrays: [(name, arrays[0])])


def _derive(item: Item, names: list[str], fn: Callable[[mx.array], Outputs]) -> Item:
    """An Item whose single output is transformed by `fn` into `names`."""
    inner = item.fn
    return Item(item.refs, names, lambda arrays: fn(inner(arrays)[0][1]))


def _stack(items: list[Item], name: str) -> Item:
    refs = [r for it in items for r in it.refs]
    sizes = [len(it.refs) for it in items]
    fns = [it.fn for it in items]

    def fn(arrays: list[mx.array]) -> Outputs:
        parts, at = [], 0
        for f, n in zip(fns, sizes, strict=True):
            parts.append(f(arrays[at : at + n])[0][1])
            at += n
        return [(name, mx.stack(parts))]

    return Item(refs, [name], fn)


class TensorRules:
    """The family-independent rules of mlx-lm's sanitize, applied per tensor as a generator.

    Experts arrive one tensor at a time and are buffered per layer until every expert is
    there; FP8 weights wait for their `weight_scale_inv`. What is still buffered at the end
    is reported, never dropped. Each rule keys on names and shapes, so its output passes
    through it unchanged (converting twice is a no-op). Rules build Jobs (recipes over
    source tensors), not arrays, so that any worker thread can run them.
    """

    def __init__(self, family: Family, *, shift_backbone: bool, shift_head: bool) -> None:
        self.family = family
        self.shift = {"backbone": shift_backbone, "head": shift_head}
        self.experts: dict[tuple[str, str], dict[int, Item]] = {}
        self.fp8: dict[str, dict[str, Ref]] = {}

    def feed(self, role: str, name: str, ref: Ref, src_dtype: str) -> Iterator[Job]:
        # FP8 block-quantized weights (DeepSeek): dequantize as mlx-lm's sanitize does.
        if name.endswith(".weight_scale_inv") or src_dtype in FP8_DTYPES:
            key = name.removesuffix("_scale_inv")
            slot = self.fp8.setdefault(key, {})
            slot["scale" if name.endswith("_scale_inv") else "weight"] = ref
            if "scale" in slot and "weight" in slot:
                del self.fp8[key]
                item = Item(
                    [slot["weight"], slot["scale"]],
                    [key],
                    lambda arrays, key=key: [(key, _dequant_fp8(arrays[0], arrays[1]))],
                )
                yield from self._split(role, item)
            return
        yield from self._split(role, _leaf(ref, name))

    def _split(self, role: str, item: Item) -> Iterator[Job]:
        name = item.names[0]
        parts = self.family.split_tensor(name)
        if parts is not None:
            names = [n for n, _ in parts]
            fns = [f for _, f in parts]
            item = _derive(
                item,
                names,
                lambda a, names=names, fns=fns: [
                    (n, f(a)) for n, f in zip(names, fns, strict=True)
                ],
            )
            yield self._job(role, item)
            return
        yield from self._experts(role, item)

    def _experts(self, role: str, item: Item) -> Iterator[Job]:
        name = item.names[0]
        if m := PER_EXPERT.match(name):
            key = (f"{m['mlp']}.switch_mlp.{m['proj']}.{m['part']}", role)
            slot = self.experts.setdefault(key, {})
            expert = int(m["expert"])
            if expert in slot:
                raise MtpkitError(f"{name} appears twice in the checkpoint")
            slot[expert] = item
            if len(slot) == self.family.num_experts:
                del self.experts[key]
                yield self._job(role, _stack([slot[e] for e in sorted(slot)], key[0]))
            return
        if m := FUSED_GATE_UP.match(name):
            gate = f"{m['mlp']}.switch_mlp.gate_proj.weight"
            up = f"{m['mlp']}.switch_mlp.up_proj.weight"

            def split(a: mx.array, gate: str = gate, up: str = up) -> Outputs:
                mid = a.shape[-2] // 2
                return [(gate, a[..., :mid, :]), (up, a[..., mid:, :])]

            yield self._job(role, _derive(item, [gate, up], split))
            return
        if m := FUSED_DOWN.match(name):
            down = f"{m['mlp']}.switch_mlp.down_proj.weight"
            yield self._job(role, _derive(item, [down], lambda a, down=down: [(down, a)]))
            return
        yield self._job(role, item)

    def _job(self, role: str, item: Item) -> Job:
        fn = item.fn
        return Job(role, item.refs, lambda arrays: [self._final(role, n, a) for n, a in fn(arrays)])

    def _final(self, role: str, name: str, array: mx.array) -> Tensor:
        if (
            self.family.has_conv1d
            and name.endswith("conv1d.weight")
            and array.ndim == 3
            and array.shape[-1] != 1
        ):
            array = array.moveaxis(2, 1)  # HF Conv1d [C, 1, K] -> MLX [C, K, 1]
        suffixes = (
            self.family.backbone_norm_suffixes
            if role == "backbone"
            else self.family.head_norm_suffixes
        )
        shift = self.shift[role] and array.ndim == 1 and name.endswith(suffixes)
        return Tensor(role, name, array, shift=shift)

    def leftovers(self) -> list[str]:
        left = [
            f"{name}: experts {sorted(slot)} of {self.family.num_experts}"
            for (name, _), slot in self.experts.items()
        ]
        left += [
            f"{name}: FP8 weight without its scale (or scale without weight)" for name in self.fp8
        ]
        return left


def _dequant_fp8(weight: mx.array, scale_inv: mx.array) -> mx.array:
    """Block-128 FP8 to bfloat16, exactly as mlx-lm's deepseek_v3 sanitize computes it."""
    weight = mx.from_fp8(weight, dtype=mx.bfloat16)
    bs = 128
    m, n = weight.shape
    pad_bottom, pad_side = (-m) % bs, (-n) % bs
    weight = mx.pad(weight, ((0, pad_bottom), (0, pad_side)))
    weight = weight.reshape(((m + pad_bottom) // bs, bs, (n + pad_side) // bs, bs))
    weight = (weight * scale_inv[:, None, :, None]).reshape(m + pad_bottom, n + pad_side)
    return weight[:m, :n].astype(mx.bfloat16)


# --------------------------------------------------------------------------- the plan


@dataclass
class Settings:
    """The resolved conversion settings (flags over recipe over defaults)."""

    bits: int | None = None
    group_size: int = 64
    keep_mtp_bf16: bool = False
    mtp_bits: int | None = None
    dtype: str | None = None
    layout: str = "sidecar"
    hidden: str = "post_norm"
    hidden_given: bool = False  # asked for by a flag or recipe (else a re-conversion keeps it)

    def validate(self) -> None:
        from mtpkit.quant import BITS, GROUP_SIZES

        if self.bits is not None and self.bits not in BITS:
            raise MtpkitError(f"--bits {self.bits} is not one of {', '.join(map(str, BITS))}")
        if self.mtp_bits is not None and self.mtp_bits not in BITS:
            raise MtpkitError(
                f"--mtp-bits {self.mtp_bits} is not one of {', '.join(map(str, BITS))}"
            )
        if self.group_size not in GROUP_SIZES:
            raise MtpkitError(
                f"--group-size {self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}"
            )
        if self.keep_mtp_bf16 and self.mtp_bits is not None:
            raise MtpkitError("--keep-mtp-bf16 and --mtp-bits contradict each other: pass one")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise MtpkitError(f"--dtype {self.dtype} is not one of {', '.join(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise MtpkitError(f"--layout {self.layout} is not one of {', '.join(LAYOUTS)}")
        if self.hidden not in HIDDEN_VARIANTS:
            raise MtpkitError(f"--hidden {self.hidden} is not one of {', '.join(HIDDEN_VARIANTS)}")

    def head_spec(self) -> QuantSpec | None:
        if self.keep_mtp_bf16:
            return None
        if self.mtp_bits is not None:
            return QuantSpec(self.mtp_bits, self.group_size)
        return QuantSpec(self.bits, self.group_size) if self.bits else None

    def head_dtype(self, default: str | None) -> str | None:
        if self.keep_mtp_bf16:
            return "float16" if self.dtype == "float16" else "bfloat16"
        return default


def _refuse_problems(ckpt: Checkpoint) -> None:
    for problem in ckpt.problems:
        if problem["code"] not in TOLERATED_PROBLEMS:
            raise CheckpointProblem(
                f"{ckpt.source.describe()} cannot be converted ({problem['code']}): "
                f"{problem['message']}"
            )


def _model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config mlx-lm builds the model from (its load_model lifts text_config's quant)."""
    config = json.loads(json.dumps(config))
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config


def _default_dtype(ckpt: Checkpoint) -> str | None:
    """The dtype `mlx_lm.convert` casts to without --dtype: the config's torch_dtype."""
    if ckpt.format == "mlx":
        return None  # an MLX directory keeps what it stores
    config = ckpt.config
    dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return dtype if dtype in DTYPES else None


def _check_conv1d(ckpt: Checkpoint, raw: bool) -> None:
    """A hybrid checkpoint's conv1d layout must agree with its format (raw HF vs MLX).

    mlx-lm infers "raw" from this shape; mtpkit records the format instead, and refuses a
    checkpoint where the two disagree rather than shifting norms twice or never.
    """
    if not ckpt.family.has_conv1d:
        return
    for info in ckpt.tensors.values():
        if info.name.endswith("conv1d.weight") and len(info.shape) == 3:
            looks_raw = info.shape[-1] != 1
            if looks_raw != raw:
                state = "raw Hugging Face" if looks_raw else "MLX"
                told = "raw" if raw else "MLX"
                raise MtpkitError(
                    f"{info.name} has the {state} layout {list(info.shape)} but the checkpoint "
                    f"is otherwise {told}: it was edited by hand or by a tool that left it "
                    "half-converted; convert from the original checkpoint"
                )
            return


@dataclass
class Plan:
    backbone: list[tuple[str, mx.array]] = field(default_factory=list)
    head: list[tuple[str, mx.array]] = field(default_factory=list)
    backbone_jobs: list[Job] = field(default_factory=list)
    head_jobs: list[Job] = field(default_factory=list)
    quant_overrides: dict[str, Any] = field(default_factory=dict)
    head_quant: dict[str, Any] = field(default_factory=dict)
    shifted: dict[str, list[str]] = field(default_factory=lambda: {"backbone": [], "head": []})
    dropped: list[str] = field(default_factory=list)
    source_head_names: list[str] = field(default_factory=list)
    total_parameters: int = 0
    head_dtype: str | None = None
    backbone_dtype: str | None = None


def _unknown_error(family: Family, where: str, names: list[str]) -> MtpkitError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return MtpkitError(
        f"{len(names)} tensors in {where} are unknown to the {family.name} family "
        f"(mlx-lm's model has no such parameters): {shown}; mtpkit refuses rather than drop them"
    )


class Converter:
    """Streams a checkpoint's tensors through the rules into a Plan of lazy outputs."""

    def __init__(self, ckpt: Checkpoint, settings: Settings, *, head_only: bool = False) -> None:
        self.ckpt = ckpt
        self.family = ckpt.family
        self.settings = settings
        self.head_only = head_only
        self.raw = ckpt.format == "hf"
        self.model = build_model(_model_config(ckpt.config))
        self.backbone_tree = ModuleTree.of(self.model)
        head_names = [
            self.family.rename_head(t.name)
            for t in ckpt.mtp_tensors
            if self.family.duplicate_of(t.name) is None
        ]
        self.has_head = bool(head_names)
        self.head_layers = _layer_count(self.family.head_prefix, head_names)
        self.head_tree = (
            ModuleTree.of(self.family.head_module(self.model, self.head_layers))
            if self.has_head
            else None
        )
        self.quant_predicate = model_quant_predicate(self.model)
        self.cast_predicate = model_cast_predicate(self.model)
        self.reader: TensorReader | None = None
        self.local = threading.local()
        self.names: set[str] = set()

    def close(self) -> None:
        """Remove temporary files of ranged reads (after the output is written)."""
        if self.reader is not None:
            self.reader.close()

    # -- which tensors --------------------------------------------------------------------
    def route(self, info: TensorInfo) -> str | None:
        """`backbone`, `head`, or None (dropped) for a source tensor."""
        name = info.name
        if info.shard in self.ckpt.sidecars or self.family.is_mtp_tensor(name):
            return None if self.family.duplicate_of(name) is not None else "head"
        if self.head_only:
            return None
        return "backbone" if self.family.rename_backbone(name) is not None else None

    def head_shift_needed(self) -> bool:
        if not self.family.zero_centred_norms:
            return False
        recorded = (self.ckpt.manifest or {}).get("rmsnorm_weight_format")
        if recorded == UNSHIFTED:
            return True
        if recorded == SHIFTED:
            return False
        if self.raw:
            return True
        if self.ckpt.sidecars and not self.ckpt.manifest:
            raise MtpkitError(
                f"{self.ckpt.source.describe()} keeps its MTP head in {self.ckpt.sidecars[0]} "
                "without a manifest saying whether its norms are shifted; convert from the "
                "original checkpoint instead"
            )
        return False  # inline MLX builds store the head already shifted

    # -- the stream ---------------------------------------------------------------------
    def plan(self) -> Plan:
        ckpt, family, settings = self.ckpt, self.family, self.settings
        plan = Plan()
        routes: dict[str, str] = {}
        for info in ckpt.tensors.values():
            role = self.route(info)
            if role is None:
                if not (self.head_only and not family.is_mtp_tensor(info.name)):
                    plan.dropped.append(info.name)
            else:
                routes[info.name] = role
                if role == "head":
                    plan.source_head_names.append(info.name)
        rules = TensorRules(
            family,
            shift_backbone=self.raw and family.zero_centred_norms,
            shift_head=self.has_head and self.head_shift_needed(),
        )
        reader = self.reader = TensorReader(
            ckpt, set(routes), ranged=self.head_only and ckpt.source.kind == "hub"
        )
        jobs: list[Job] = []
        seen: set[str] = set()
        for shard in ckpt.shards + ckpt.sidecars:
            if shard not in ckpt.headers:
                continue
            for info, ref in reader.shard(shard):
                # A head written both inline and in the sidecar (--layout inline) is read once.
                if info.name in seen:
                    continue
                seen.add(info.name)
                role = routes[info.name]
                if role == "head":
                    name = family.rename_head(info.name)
                else:
                    name = family.rename_backbone(info.name)
                    assert name is not None
                jobs.extend(rules.feed(role, name, ref, info.dtype))
        left = rules.leftovers()
        if left:
            raise MtpkitError(
                f"incomplete tensor groups in {ckpt.source.describe()}: {'; '.join(left[:3])}"
            )
        # Build every output lazily once, on this thread, for names, shapes and dtypes; these
        # arrays are never evaluated (workers rebuild each job where they run it).
        loads: dict[str, dict[str, mx.array]] = {}
        per_job: list[list[Tensor]] = []
        for job in jobs:
            for r in job.refs:
                if r.path not in loads:
                    loads[r.path] = _load(r.path)
            per_job.append(job.make([loads[r.path][r.name] for r in job.refs]))
        self._validate([t for tensors in per_job for t in tensors])

        default = settings.dtype or _default_dtype(ckpt)
        plan.backbone_dtype = self.backbone_dtype = default
        plan.head_dtype = self.head_dtype = settings.head_dtype(default)
        self.names = {t.name for tensors in per_job for t in tensors}
        for job, tensors in zip(jobs, per_job, strict=True):
            job.source_bytes = sum(ckpt.tensors[r.name].nbytes for r in job.refs)
            for t in tensors:
                entries = self.finish(t, plan)
                job.entry_names.extend(n for n, _ in entries)
                job.nbytes += sum(a.nbytes for _, a in entries)
                (plan.head if t.role == "head" else plan.backbone).extend(entries)
                if t.shift:
                    plan.shifted[t.role].append(t.name)
            (plan.head_jobs if job.role == "head" else plan.backbone_jobs).append(job)
        if self.has_head:
            self._record_head_quant(plan, self.names)
        return plan

    def finish(self, t: Tensor, plan: Plan | None = None) -> list[tuple[str, mx.array]]:
        """Cast, shift and quantize one tensor (recording the decisions into `plan`)."""
        settings = self.settings
        if t.role == "head":
            dtype, tree, spec = self.head_dtype, self.head_tree, settings.head_spec()
        else:
            dtype, tree = self.backbone_dtype, self.backbone_tree
            spec = QuantSpec(settings.bits, settings.group_size) if settings.bits else None
        packed = t.name.removesuffix(".weight") + ".scales" in self.names
        return self._finish(t, tree, dtype, spec, packed, plan)

    def run(self, job: Job) -> list[tuple[str, mx.array]]:
        """Compute one job's output entries (in the calling thread's stream)."""
        # Files are opened per thread: MLX arrays belong to their thread's stream.
        if not hasattr(self.local, "loads"):
            self.local.loads = {}
        cache = self.local.loads
        arrays = []
        for r in job.refs:
            loaded = cache.get(r.path)
            if loaded is None:
                loaded = cache[r.path] = _load(r.path)
            arrays.append(loaded.pop(r.name))
        return [e for t in job.make(arrays) for e in self.finish(t)]

    def _validate(self, outputs: list[Tensor]) -> None:
        for role, tree in (("backbone", self.backbone_tree), ("head", self.head_tree)):
            if tree is None or (role == "backbone" and self.head_only):
                continue
            produced = {t.name: t for t in outputs if t.role == role}
            unknown = []
            for name in produced:
                module, _, leaf = name.rpartition(".")
                if name in tree.params:
                    continue
                if leaf in ("scales", "biases") and module in tree.quantizable:
                    continue
                unknown.append(name)
            where = self.ckpt.source.describe() + (" (MTP head)" if role == "head" else "")
            if unknown:
                raise _unknown_error(self.family, where, sorted(unknown))
            missing = sorted(set(tree.params) - set(produced))
            if missing:
                shown = ", ".join(missing[:5])
                raise MtpkitError(
                    f"{where} lacks {len(missing)} tensors the {self.family.name} "
                    f"{'head' if role == 'head' else 'model'} needs: {shown}"
                )
            for name, t in produced.items():
                expected = tree.params.get(name)
                packed = name.removesuffix(".weight") + ".scales" in produced
                if expected is not None and not packed and tuple(t.array.shape) != expected[0]:
                    raise MtpkitError(
                        f"{name} in {where} has shape {list(t.array.shape)}, the config implies "
                        f"{list(expected[0])}: the config does not match the weights"
                    )

    def _finish(
        self,
        t: Tensor,
        tree: ModuleTree | None,
        dtype: str | None,
        spec: QuantSpec | None,
        packed: bool,
        plan: Plan | None,
    ) -> list[tuple[str, mx.array]]:
        """Cast, shift and quantize one tensor; returns the output entries."""
        plan = plan if plan is not None else Plan()  # decisions are only kept while planning
        array = t.array
        cast = (
            dtype is not None
            and is_floating(array.dtype)
            and (t.role == "head" or self.cast_predicate(t.name))
        )
        target = getattr(mx, dtype) if cast else array.dtype
        if t.shift:
            # +1 in float32, then one rounding to the output dtype (MTP_FORMATS.md, precision).
            array = (array.astype(mx.float32) + 1.0).astype(target)
        elif cast and array.dtype != target:
            array = array.astype(target)
        path = t.name.removesuffix(".weight")
        if packed or not t.name.endswith(".weight") or spec is None or tree is None:
            plan.total_parameters += self._count(t, tree) if t.role == "backbone" else 0
            return [(t.name, array)]
        chosen, explicit = quant_decision(path, tree, spec, self.quant_predicate)
        if chosen is None:
            if t.role == "backbone":
                plan.total_parameters += self._count(t, tree)
            return [(t.name, array)]
        if t.role == "backbone" and explicit:
            plan.quant_overrides[path] = chosen.as_config()
        if t.role == "backbone":
            plan.total_parameters += self._count(t, tree)
        weight, scales, biases = quantize(array, chosen)
        return [(f"{path}.weight", weight), (f"{path}.scales", scales), (f"{path}.biases", biases)]

    def _count(self, t: Tensor, tree: ModuleTree | None) -> int:
        """Parameters as mlx-lm's get_total_parameters counts them: those of leaf modules
        only (not e.g. a gated delta net's own A_log), packed weights unpacked."""
        module, _, leaf = t.name.rpartition(".")
        if tree is not None and module not in tree.leaves:
            return 0
        if leaf in ("scales", "biases") and tree is not None and module in tree.quantizable:
            return 0
        if leaf == "weight" and tree is not None and module in tree.quantizable:
            expected = tree.params.get(t.name)
            if expected is not None and tuple(t.array.shape) != expected[0]:
                return int(np.prod(expected[0]))
        return t.array.size

    def _record_head_quant(self, plan: Plan, source_names: set[str]) -> None:
        """Per-path quantization of every quantizable head module, for config and manifest."""
        assert self.head_tree is not None
        written = dict(plan.head)
        for path, module in sorted(self.head_tree.quantizable.items()):
            scales = written.get(f"{path}.scales")
            if scales is None:
                plan.head_quant[path] = False
                continue
            weight = written[f"{path}.weight"]
            in_dims = module.weight.shape[-1]
            plan.head_quant[path] = infer_spec(
                tuple(weight.shape), tuple(scales.shape), in_dims
            ).as_config()


# --------------------------------------------------------------------------- writing


def _progress(total: int, quiet: bool, desc: str) -> Any:
    from mtpkit.output import progress_disabled

    if progress_disabled(quiet):
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, leave=False)


def _output_config(ckpt: Checkpoint, plan: Plan, settings: Settings, layers: int) -> dict[str, Any]:
    """config.json as mlx_lm.convert's save_config writes it, plus the MTP declaration."""
    config = json.loads(json.dumps(ckpt.config))
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    generation = (
        ckpt.source.read_json("generation_config.json")
        if ckpt.source.has("generation_config.json")
        else None
    )
    if isinstance(generation, dict) and generation.get("eos_token_id"):
        config["eos_token_id"] = generation["eos_token_id"]  # mlx-lm's load_config does this
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
        config.pop("quantization_config")  # dequantized above: the weights are no longer FP8
    quant: dict[str, Any] | None = config.get("quantization")
    if settings.bits:
        quant = {"group_size": settings.group_size, "bits": settings.bits, "mode": "affine"}
        quant.update(plan.quant_overrides)
    _set_quantization(config, quant, ckpt.family, plan, settings)
    if layers:
        ckpt.family.declare_mtp(config, layers)
    return dict(sorted(config.items()))


def _set_quantization(
    config: dict[str, Any],
    quant: dict[str, Any] | None,
    family: Family,
    plan: Plan,
    settings: Settings,
) -> None:
    """Write the backbone's quantization (`quant`, any old head entries dropped) plus one entry
    per head module into `config`, as mlx-lm's loader reads them."""
    if quant is not None:
        quant = {k: v for k, v in quant.items() if not k.startswith(family.head_prefix)}
    if quant is None and any(plan.head_quant.values()):
        spec = settings.head_spec()
        assert spec is not None
        quant = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
    if quant is not None:
        quant.update(plan.head_quant)
        config["quantization"] = quant
        config["quantization_config"] = quant


def _manifest(
    ckpt: Checkpoint, plan: Plan, settings: Settings, layers: int, *, backbone_quant: Any
) -> dict[str, Any]:
    family = ckpt.family
    previous = ckpt.manifest if (ckpt.manifest or {}).get("format") == MANIFEST_FORMAT else None
    source = {
        "spec": ckpt.source.spec,
        "revision": ckpt.source.revision,
        "commit": ckpt.source.commit,
    }
    shifted = {"backbone": sorted(plan.shifted["backbone"]), "mtp": sorted(plan.shifted["head"])}
    if previous is not None:
        # Converting mtpkit's own output: the first conversion's record stays the truth.
        source = previous.get("source", source)
        old = previous.get("norm_shift") or {}
        shifted = {
            "backbone": sorted(set(old.get("backbone", [])) | set(shifted["backbone"])),
            "mtp": sorted(set(old.get("mtp", [])) | set(shifted["mtp"])),
        }
    head_quant_values = [v for v in plan.head_quant.values() if v]
    main = None
    if head_quant_values:
        counts: dict[tuple[int, int], int] = {}
        for v in head_quant_values:
            counts[(v["bits"], v["group_size"])] = counts.get((v["bits"], v["group_size"]), 0) + 1
        bits, group = max(counts, key=lambda k: counts[k])
        main = {"bits": bits, "group_size": group}
    head_dtypes = sorted(
        {
            dtype_name(a.dtype)
            for n, a in plan.head
            if is_floating(a.dtype) and not n.endswith((".scales", ".biases"))
        }
    )
    return {
        "format": MANIFEST_FORMAT,
        "mtpkit_version": __version__,
        "family": family.name,
        "model_type": ckpt.config.get("model_type"),
        "source": source,
        "weights": Path(HEAD_WEIGHTS_PATH).name,
        "prefix": family.head_prefix,
        "num_layers": layers,
        "layout": settings.layout,
        "rmsnorm_weight_format": SHIFTED if family.zero_centred_norms else PLAIN,
        "norm_shift": {
            **shifted,
            "dtype": "float32" if (shifted["backbone"] or shifted["mtp"]) else None,
        },
        "hidden": settings.hidden
        if settings.hidden_given
        else (previous or {}).get("hidden", settings.hidden),
        "concat_order": family.concat_order,
        "expert_layout": {
            "source": expert_layout(plan.source_head_names),
            "output": expert_layout([n for n, _ in plan.head]),
        },
        "mtp_dtype": head_dtypes[0] if len(head_dtypes) == 1 else (head_dtypes or None),
        "mtp_quantization": main,
        "mtp_quantization_paths": plan.head_quant,
        "backbone_quantization": backbone_quant,
        "dropped": sorted(plan.dropped),
    }


def _layer_count(head_prefix: str, names: list[str]) -> int:
    """MTP layers present, from the head's tensor names (`{prefix}layers.{i}.`)."""
    prefix = head_prefix + "layers."
    return len({n[len(prefix) :].split(".", 1)[0] for n in names if n.startswith(prefix)})


def _head_layers(family: Family, plan: Plan) -> int:
    return _layer_count(family.head_prefix, [n for n, _ in plan.head])


def _copy_side_files(ckpt: Checkpoint, out: Path) -> None:
    for name in sorted(ckpt.source.files):
        if "/" in name or not COPIED_FILES.match(name):
            continue
        shutil.copyfile(ckpt.source.local_file(name), out / name)


def _temp_sibling(out: Path) -> Path:
    return out.parent / f".{out.name}.mtpkit-tmp-{os.getpid()}"


def _meta(plan_entries: list[tuple[str, mx.array]]) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    return {n: (tuple(a.shape), a.dtype) for n, a in plan_entries}


def _shard_jobs(jobs: list[Job], max_bytes: int) -> list[list[Job]]:
    """Jobs in order over shards of at most `max_bytes` (mlx-lm's make_shards, per job)."""
    shards: list[list[Job]] = []
    size = 0
    for job in jobs:
        if not shards or size + job.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += job.nbytes
    return shards


def _write_jobs(
    converter: Converter,
    files: list[tuple[Path, list[Job]]],
    meta: dict[str, tuple[tuple[int, ...], mx.Dtype]],
    bar: Any,
) -> None:
    """Lay out every file, then compute each job once and write it to every file it is in."""
    destinations: dict[str, list[tuple[int, int]]] = {}
    fds: list[int] = []
    order: list[Job] = []
    seen: set[int] = set()
    try:
        for path, jobs in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = [(n, *meta[n]) for job in jobs for n in job.entry_names]
            layout = FileLayout(path, entries, metadata={"format": "mlx"})
            fd = layout.create()
            fds.append(fd)
            for name, offset in layout.offsets.items():
                destinations.setdefault(name, []).append((fd, offset))
            for job in jobs:
                if id(job) not in seen:
                    seen.add(id(job))
                    order.append(job)
        run_jobs(
            order,
            converter.run,
            destinations,
            workers=default_workers(),
            size=lambda job: job.source_bytes,
            on_bytes=bar.update if bar is not None else None,
        )
    finally:
        for fd in fds:
            os.close(fd)


def convert(
    source: str,
    *,
    output: str | Path,
    revision: str | None = None,
    bits: int | None = None,
    group_size: int | None = None,
    keep_mtp_bf16: bool = False,
    mtp_bits: int | None = None,
    dtype: str | None = None,
    layout: str | None = None,
    hidden: str | None = None,
    recipe: str | Path | None = None,
    force: bool = False,
    quiet: bool = True,
) -> ConvertResult:
    """Convert `source` (local dir or Hub repo) into an MLX directory at `output`.

    Flags override the recipe's settings. The directory is written into a temporary sibling
    and renamed at the end, so an interrupted run leaves no `output`.
    """
    started = time.perf_counter()
    settings, recipe_family = resolve_settings(
        recipe,
        bits=bits,
        group_size=group_size,
        keep_mtp_bf16=keep_mtp_bf16,
        mtp_bits=mtp_bits,
        dtype=dtype,
        layout=layout,
        hidden=hidden,
    )
    out = Path(output).expanduser()
    if out.exists() and not force:
        raise MtpkitError(f"{out} already exists: pass --force to replace it, or choose another -o")
    ckpt = read_checkpoint(source, revision=revision)
    _refuse_problems(ckpt)
    if recipe_family is not None and recipe_family != ckpt.family.name:
        raise MtpkitError(
            f"recipe {recipe} is for {recipe_family} models but {ckpt.source.describe()} is "
            f"{ckpt.family.name}: pick the recipe of this model"
        )
    if settings.layout == "inline" and ckpt.family.head_prefix != "language_model.mtp.":
        raise MtpkitError(
            f"--layout inline exists only for the Qwen3.5/3.6 families, not {ckpt.family.name}"
        )
    if out.exists() and Path(ckpt.source.spec).expanduser().resolve() == out.resolve():
        raise MtpkitError(f"{out} is the source itself: write the conversion elsewhere")
    source_quant = ckpt.config.get("quantization")
    if source_quant is not None and (settings.bits or settings.mtp_bits or settings.keep_mtp_bf16):
        origin = ((ckpt.manifest or {}).get("source") or {}).get("spec")
        hint = f" ({origin})" if origin else ""
        raise MtpkitError(
            f"{ckpt.source.describe()} is already quantized ({source_quant.get('bits')}-bit): "
            f"quantizing it again would compound the error; convert from the original "
            f"checkpoint{hint} instead"
        )
    raw = ckpt.format == "hf"
    _check_conv1d(ckpt, raw)

    converter = Converter(ckpt, settings)
    # MLX keeps freed buffers for reuse (much faster than fresh pages); a bound keeps tensors
    # of ever-new sizes from piling up there.
    cache_limit = mx.set_cache_limit(BUFFER_CACHE_BYTES)
    try:
        return _convert_planned(ckpt, converter, settings, out, quiet, started)
    finally:
        mx.set_cache_limit(cache_limit)
        converter.close()


def _convert_planned(
    ckpt: Checkpoint,
    converter: Converter,
    settings: Settings,
    out: Path,
    quiet: bool,
    started: float,
) -> ConvertResult:
    source_quant = ckpt.config.get("quantization")
    plan = converter.plan()
    layers = _head_layers(ckpt.family, plan)
    if settings.bits:
        backbone_quant: Any = {"bits": settings.bits, "group_size": settings.group_size}
    elif source_quant is not None:
        backbone_quant = {
            "bits": source_quant.get("bits"),
            "group_size": source_quant.get("group_size"),
        }
    else:
        backbone_quant = None
    config = _output_config(ckpt, plan, settings, layers)
    manifest = _manifest(ckpt, plan, settings, layers, backbone_quant=backbone_quant)

    tmp = _temp_sibling(out)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise MtpkitError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        n_backbone, n_head = len(plan.backbone), len(plan.head)
        meta = _meta(plan.backbone + plan.head)
        model_jobs = plan.backbone_jobs + (plan.head_jobs if settings.layout == "inline" else [])
        shards = _shard_jobs(model_jobs, MAX_SHARD_BYTES)
        files = [(tmp / shard_name(i, len(shards)), jobs) for i, jobs in enumerate(shards)]
        weight_map = {n: path.name for path, jobs in files for job in jobs for n in job.entry_names}
        total_size = sum(job.nbytes for job in model_jobs)
        if plan.head_jobs:
            files.append((tmp / HEAD_WEIGHTS_PATH, plan.head_jobs))
        total = sum(job.nbytes for _, jobs in files for job in jobs)
        bar = _progress(total, quiet, "convert")
        _write_jobs(converter, files, meta, bar)
        write_index(
            tmp / "model.safetensors.index.json", weight_map, total_size, plan.total_parameters
        )
        if plan.head_jobs:
            write_manifest(tmp / MANIFEST_PATH, manifest)
        if bar is not None:
            bar.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=4))
        _copy_side_files(ckpt, tmp)
        if out.exists():
            trash = out.parent / f".{out.name}.mtpkit-old-{os.getpid()}"
            out.rename(trash)
            tmp.rename(out)
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash)
            else:
                trash.unlink()
        else:
            tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MtpkitError(f"writing {out} failed, nothing was written: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(
        out, ckpt.family.name, manifest, n_backbone, n_head, time.perf_counter() - started
    )


# --------------------------------------------------------------------------- graft


TRUNK_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers")


def _trunk_dtype(trunk: Checkpoint) -> str | None:
    """The float dtype the trunk stores its unquantized tensors in (its norms, scales)."""
    counts: dict[str, int] = {}
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    for t in trunk.tensors.values():
        if t.dtype in names and t.name.endswith(("norm.weight", ".scales")):
            counts[names[t.dtype]] = counts.get(names[t.dtype], 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


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
    quiet: bool = True,
) -> ConvertResult:
    """Add the MTP head of `source` to the existing MLX conversion `into`.

    Only the head's tensors are read (on the Hub: their byte ranges). The trunk must be the
    same model (model_type, hidden size, vocab size, layer count); its quantization is kept
    and the head is quantized like it unless a head flag says otherwise.
    """
    started = time.perf_counter()
    into = Path(into).expanduser()
    if not (into / "config.json").is_file():
        raise MtpkitError(f"--into {into} is not an MLX model directory (no config.json)")
    trunk = read_checkpoint(str(into))
    if trunk.format != "mlx":
        raise MtpkitError(f"--into {into} is not an MLX conversion; run `mtpkit convert` instead")
    ckpt = read_checkpoint(source, revision=revision)
    _refuse_problems(ckpt)
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
    trunk_quant = trunk.config.get("quantization")
    settings = Settings(
        bits=trunk_quant.get("bits") if trunk_quant else None,
        group_size=group_size or (trunk_quant or {}).get("group_size") or 64,
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
        return _graft_planned(ckpt, converter, settings, into, trunk_quant, quiet, started)
    finally:
        mx.set_cache_limit(cache_limit)
        converter.close()


def _graft_planned(
    ckpt: Checkpoint,
    converter: Converter,
    settings: Settings,
    into: Path,
    trunk_quant: dict[str, Any] | None,
    quiet: bool,
    started: float,
) -> ConvertResult:
    plan = converter.plan()
    plan.backbone_dtype = None
    layers = _head_layers(ckpt.family, plan)

    config = json.loads((into / "config.json").read_text())
    _set_quantization(config, config.get("quantization"), ckpt.family, plan, settings)
    ckpt.family.declare_mtp(config, layers)
    backbone_quant = (
        {"bits": trunk_quant.get("bits"), "group_size": trunk_quant.get("group_size")}
        if trunk_quant
        else None
    )
    manifest = _manifest(ckpt, plan, settings, layers, backbone_quant=backbone_quant)
    manifest["grafted_into"] = str(into)

    bar = _progress(sum(a.nbytes for _, a in plan.head), quiet, "graft")
    weights = into / HEAD_WEIGHTS_PATH
    tmp_weights = weights.with_name(f".{weights.name}.mtpkit-tmp-{os.getpid()}")
    tmp_weights.parent.mkdir(parents=True, exist_ok=True)
    try:
        n_head = len(plan.head)
        _write_jobs(converter, [(tmp_weights, plan.head_jobs)], _meta(plan.head), bar)
        if bar is not None:
            bar.close()
        tmp_manifest = weights.parent / f".manifest.json.mtpkit-tmp-{os.getpid()}"
        write_manifest(tmp_manifest, manifest)
        tmp_config = into / f".config.json.mtpkit-tmp-{os.getpid()}"
        tmp_config.write_text(json.dumps(dict(sorted(config.items())), indent=4))
        os.replace(tmp_weights, weights)
        os.replace(tmp_manifest, into / MANIFEST_PATH)
        os.replace(tmp_config, into / "config.json")
    except BaseException as e:
        for leftover in into.glob("**/.*.mtpkit-tmp-*"):
            leftover.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise MtpkitError(f"grafting into {into} failed: {e}") from None
        raise
    return ConvertResult(into, ckpt.family.name, manifest, 0, n_head, time.perf_counter() - started)


# --------------------------------------------------------------------------- settings


def resolve_settings(
    recipe: str | Path | None,
    **flags: Any,
) -> tuple[Settings, str | None]:
    """Defaults, then the recipe's values, then every flag that was given.

    Returns the settings and the family the recipe is meant for (None without a recipe).
    """
    from mtpkit.recipes import load_recipe

    values: dict[str, Any] = {}
    family = None
    if recipe is not None:
        loaded = load_recipe(recipe)
        values.update(loaded.settings)
        family = loaded.family
    if flags.get("keep_mtp_bf16") and flags.get("mtp_bits") is not None:
        raise MtpkitError("--keep-mtp-bf16 and --mtp-bits contradict each other: pass one")
    # A head flag replaces the recipe's head choice, whichever it was.
    if flags.get("mtp_bits") is not None:
        values.pop("keep_mtp_bf16", None)
    if flags.get("keep_mtp_bf16"):
        values.pop("mtp_bits", None)
    for key, value in flags.items():
        if value is not None and value is not False:
            values[key] = value
    if values.get("group_size") is None:
        values.pop("group_size", None)
    values["hidden_given"] = "hidden" in values
    settings = Settings(**values)
    settings.validate()
    return settings, family


__all__ = ["ConvertResult", "Settings", "convert", "graft", "resolve_settings"]
