"""The plan of a conversion: which tensors, from where, to what.

`Converter.plan()` routes every source tensor (backbone, head, or dropped), streams them
shard by shard through the family's renames and the tensor rules (`mtpkit.convert.rules`),
checks the outputs against mlx-lm's own model and the family's head module, and records
every output's name, shape and dtype and each cast, shift and quantization decision in a
`Plan`, each job carrying what was decided for its outputs (`rules.Finish`). Nothing is
computed here: the writer's threads compute each job from the job alone
(`rules.job_computer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mtpkit.checkpoint.inspect import Checkpoint
from mtpkit.convert.quant import (
    ModuleTree,
    Predicate,
    QuantSpec,
    build_model,
    count_parameters,
    head_predicate,
    is_floating,
    mixed_predicate,
    mode_problem,
    model_cast_predicate,
    model_quant_predicate,
    quant_decision,
    quantization_paths,
)
from mtpkit.convert.reader import TensorReader, load_tensors
from mtpkit.convert.rules import Finish, Job, Tensor, TensorRules, finish, is_raw_conv1d
from mtpkit.convert.writer import decode_floats
from mtpkit.core.choices import (
    BITS,
    DEFAULT_HIDDEN,
    DTYPES,
    GROUP_SIZES,
    HIDDEN_VARIANTS,
    LAYOUTS,
    MODES,
    QUANT_PREDICATES,
)
from mtpkit.core.errors import CheckpointProblem, MtpkitError
from mtpkit.core.manifest import SHIFTED, UNSHIFTED, head_layer_count
from mtpkit.families import Family

# Problems inspect may report that do not make a conversion unsafe: convert declares the
# head in the output config itself.
# Problems convert repairs: it declares the MTP layers the weights hold, with a warning.
TOLERATED_PROBLEMS = {"mtp_present_not_declared", "mtp_layer_count_mismatch"}

Entries = list[tuple[str, mx.array]]


@dataclass
class Settings:
    """The resolved conversion settings (flags over recipe over defaults)."""

    bits: int | None = None
    group_size: int | None = None
    keep_mtp_bf16: bool = False
    mtp_bits: int | None = None
    dtype: str | None = None
    layout: str = "sidecar"
    hidden: str = DEFAULT_HIDDEN
    hidden_given: bool = False  # asked for by a flag or recipe (else a re-conversion keeps it)
    quantize: bool = False  # -q: quantize the backbone (implied by bits, mode or predicate)
    mode: str = "affine"
    quant_predicate: str | None = None
    draft_vocab: int | None = None  # --draft-vocab N: the head drafts over N ids
    draft_vocab_corpus: tuple[str, ...] = ()  # the files whose token counts choose them

    def validate(self) -> None:
        choices = (
            ("--q-bits", self.bits, BITS),
            ("--mtp-bits", self.mtp_bits, BITS),
            ("--q-group-size", self.group_size, GROUP_SIZES),
            ("--q-mode", self.mode, MODES),
            ("--quant-predicate", self.quant_predicate, QUANT_PREDICATES),
            ("--dtype", self.dtype, DTYPES),
            ("--layout", self.layout, LAYOUTS),
            ("--hidden", self.hidden, HIDDEN_VARIANTS),
        )
        for flag, value, allowed in choices:
            if value is not None and value not in allowed:
                raise MtpkitError(f"{flag} {value} is not one of {', '.join(map(str, allowed))}")
        if self.keep_mtp_bf16 and self.mtp_bits is not None:
            raise MtpkitError("--keep-mtp-bf16 and --mtp-bits contradict each other: pass one")
        if self.quant_predicate is not None and self.mode != "affine":
            # mlx_lm.convert's own rule: its recipes are affine bit mixes.
            raise MtpkitError(
                f"--quant-predicate {self.quant_predicate} supports only --q-mode affine, "
                f"not {self.mode}"
            )
        if self.draft_vocab_corpus:
            from mtpkit.core.corpus import check_files

            if self.draft_vocab is None:
                raise MtpkitError("--draft-vocab-corpus chooses the ids of --draft-vocab N: pass both")
            check_files(self.draft_vocab_corpus, "--draft-vocab-corpus")
        quantizing = self.quantizes_backbone or self.mtp_bits is not None
        if quantizing and (problem := mode_problem(self.mode, self.bits, self.group_size)):
            raise MtpkitError(problem)

    @property
    def quantizes_backbone(self) -> bool:
        return bool(self.quantize or self.bits or self.mode != "affine" or self.quant_predicate)

    def backbone_spec(self) -> QuantSpec | None:
        if not self.quantizes_backbone:
            return None
        return QuantSpec.for_mode(self.mode, self.bits, self.group_size)

    def head_spec(self) -> QuantSpec | None:
        """The head's quantization: none with --keep-mtp-bf16; affine at --mtp-bits (group
        --q-group-size, else 64); else the backbone's."""
        if self.keep_mtp_bf16:
            return None
        if self.mtp_bits is not None:
            group = self.group_size if self.mode == "affine" and self.group_size else None
            return QuantSpec.for_mode("affine", self.mtp_bits, group)
        return self.backbone_spec()

    def head_dtype(self, default: str | None) -> str | None:
        if self.keep_mtp_bf16:
            return "float16" if self.dtype == "float16" else "bfloat16"
        return default

    def backbone_record(self) -> dict[str, Any] | None:
        """The backbone's quantization for the manifest: {bits, group_size, mode} and the
        predicate recipe when one was given."""
        spec = self.backbone_spec()
        if spec is None:
            return None
        record: dict[str, Any] = {"bits": spec.bits, "group_size": spec.group_size}
        record["mode"] = spec.mode
        if self.quant_predicate:
            record["predicate"] = self.quant_predicate
        return record


@dataclass
class Plan:
    backbone: Entries = field(default_factory=list)
    head: Entries = field(default_factory=list)
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

    def head_layers(self, family: Family) -> int:
        """MTP layers among the head's outputs, as the config counts them."""
        return family.config_mtp_layers(
            head_layer_count(family.head_prefix, [n for n, _ in self.head])
        )


def refuse_problems(ckpt: Checkpoint) -> None:
    """Raise on any problem inspect found that makes converting `ckpt` unsafe."""
    for problem in ckpt.problems:
        if problem["code"] not in TOLERATED_PROBLEMS:
            raise CheckpointProblem(
                f"{ckpt.source.describe()} cannot be converted ({problem['code']}): "
                f"{problem['message']}"
            )


def check_conv1d(ckpt: Checkpoint) -> None:
    """A hybrid checkpoint's conv1d layout must agree with its format (raw HF vs MLX).

    mlx-lm infers "raw" from this shape; mtpkit records the format instead, and refuses a
    checkpoint where the two disagree rather than shifting norms twice or never.
    """
    if not ckpt.family.has_conv1d:
        return
    raw = ckpt.format == "hf"
    for info in ckpt.tensors.values():
        if info.name.endswith("conv1d.weight") and len(info.shape) == 3:
            looks_raw = is_raw_conv1d(info.shape)
            if looks_raw != raw:
                state = "raw Hugging Face" if looks_raw else "MLX"
                told = "raw" if raw else "MLX"
                raise MtpkitError(
                    f"{info.name} has the {state} layout {list(info.shape)} but the checkpoint "
                    f"is otherwise {told}: it was edited by hand or by a tool that left it "
                    "half-converted; convert from the original checkpoint"
                )
            return


def _model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config mlx-lm builds the model from (its load_model lifts text_config's quant)."""
    config = decode_floats(config)
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


class Converter:
    """Streams a checkpoint's tensors through the rules into a Plan of lazy outputs."""

    def __init__(self, ckpt: Checkpoint, settings: Settings, *, head_only: bool = False) -> None:
        self.ckpt = ckpt
        self.family = ckpt.family
        self.settings = settings
        self.head_only = head_only
        self.raw = ckpt.format == "hf"
        # A standalone drafter (Gemma 4's assistant) is a model of its own that mlx-lm does
        # not build: its family's module is the model converted, as a whole.
        standalone = self.family.standalone
        self.model = (
            self.family.build_model() if standalone else build_model(_model_config(ckpt.config))
        )
        self.backbone_tree = ModuleTree.of(self.model)
        head_names = [
            self.family.rename_head(t.name)
            for t in ckpt.mtp_tensors
            if self.family.duplicate_of(t.name) is None and not standalone
        ]
        self.has_head = bool(head_names)
        self.head_layers = head_layer_count(self.family.head_prefix, head_names)
        self.head_tree = (
            ModuleTree.of(self.family.head_module(self.model, self.head_layers, head_names))
            if self.has_head
            else None
        )
        self.quant_predicate, self.head_quant_predicate = self._quant_predicates()
        self.cast_predicate = model_cast_predicate(self.model)
        self.reader: TensorReader | None = None
        self.names: set[str] = set()
        self.backbone_dtype: str | None = None
        self.head_dtype: str | None = None

    def _quant_predicates(self) -> tuple[Predicate | None, Predicate | None]:
        """(backbone, head) predicates: mlx-lm's mixed recipe replaces the model's own, as in
        mlx_lm.convert; the head follows the recipe's rule for its layers unless --mtp-bits
        chose its bits (then the model's own predicate, e.g. 8-bit routers, applies)."""
        own = model_quant_predicate(self.model)
        recipe = self.settings.quant_predicate
        if recipe is None or not self.settings.quantizes_backbone:
            return own, own
        mixed = mixed_predicate(recipe, self.model, self.settings.group_size)
        if self.settings.mtp_bits is not None:
            return mixed, own
        return mixed, head_predicate(mixed, self.model, self.family.head_prefix)

    def close(self) -> None:
        """Remove temporary files of ranged reads (after the output is written)."""
        if self.reader is not None:
            self.reader.close()

    # -- which tensors --------------------------------------------------------------------
    def route(self, name: str, shard: str) -> str | None:
        """`backbone`, `head`, or None (dropped) for a source tensor."""
        if self.family.standalone:
            return "backbone" if self.family.rename_backbone(name) is not None else None
        if shard in self.ckpt.sidecars or self.family.is_mtp_tensor(name):
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

    # -- the plan -------------------------------------------------------------------------
    def plan(self) -> Plan:
        plan = Plan()
        routes = self._routes(plan)
        jobs = self._stream(routes)
        per_job = self._preview(jobs)
        self._check([t for tensors in per_job for t in tensors])
        default = self.settings.dtype or _default_dtype(self.ckpt)
        plan.backbone_dtype = self.backbone_dtype = default
        plan.head_dtype = self.head_dtype = self.settings.head_dtype(default)
        self.names = {t.name for tensors in per_job for t in tensors}
        self._record(plan, jobs, per_job)
        if self.head_tree is not None:
            plan.head_quant = quantization_paths(self.head_tree, dict(plan.head))
        return plan

    def _routes(self, plan: Plan) -> dict[str, str]:
        """Source tensor -> role for every tensor read; the rest go to `plan.dropped`."""
        routes: dict[str, str] = {}
        for info in self.ckpt.tensors.values():
            role = self.route(info.name, info.shard)
            if role is None:
                if not (self.head_only and not self.family.is_mtp_tensor(info.name)):
                    plan.dropped.append(info.name)
            else:
                routes[info.name] = role
                if role == "head":
                    plan.source_head_names.append(info.name)
        return routes

    def _stream(self, routes: dict[str, str]) -> list[Job]:
        """Every routed tensor, renamed, through the tensor rules, shard by shard."""
        ckpt, family = self.ckpt, self.family
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
        return jobs

    def _preview(self, jobs: list[Job]) -> list[list[Tensor]]:
        """Every job's outputs built lazily once, on this thread, for names, shapes and
        dtypes; never evaluated (workers rebuild each job where they run it)."""
        loads: dict[str, dict[str, mx.array]] = {}
        per_job: list[list[Tensor]] = []
        for job in jobs:
            for r in job.refs:
                if r.path not in loads:
                    loads[r.path] = load_tensors(r.path)
            per_job.append(job.make([loads[r.path][r.name] for r in job.refs]))
        return per_job

    def _record(self, plan: Plan, jobs: list[Job], per_job: list[list[Tensor]]) -> None:
        """Each job's output entries, sizes and decisions, into `plan`."""
        for job, tensors in zip(jobs, per_job, strict=True):
            job.source_bytes = sum(self.ckpt.tensors[r.name].nbytes for r in job.refs)
            for t in tensors:
                decided = job.finishes[t.name] = self.decide(t, plan)
                entries = finish(t, decided)
                job.entry_names.extend(n for n, _ in entries)
                job.nbytes += sum(a.nbytes for _, a in entries)
                (plan.head if t.role == "head" else plan.backbone).extend(entries)
                if t.shift:
                    plan.shifted[t.role].append(t.name)
            (plan.head_jobs if job.role == "head" else plan.backbone_jobs).append(job)

    def _check(self, outputs: list[Tensor]) -> None:
        for role, tree in (("backbone", self.backbone_tree), ("head", self.head_tree)):
            if tree is None or (role == "backbone" and self.head_only):
                continue
            where = self.ckpt.source.describe() + (" (MTP head)" if role == "head" else "")
            what = "head" if role == "head" else "model"
            produced = {t.name: tuple(t.array.shape) for t in outputs if t.role == role}
            check_outputs(tree, produced, where=where, family=self.family.name, what=what)

    # -- what becomes of each output ------------------------------------------------------
    def decide(self, t: Tensor, plan: Plan) -> Finish:
        """Cast and quantization of one output tensor; overrides and parameter counts go
        into `plan`."""
        if t.role == "head":
            dtype, tree, spec = self.head_dtype, self.head_tree, self.settings.head_spec()
            predicate = self.head_quant_predicate
        else:
            dtype, tree = self.backbone_dtype, self.backbone_tree
            spec, predicate = self.settings.backbone_spec(), self.quant_predicate
        cast = self._cast_dtype(t, dtype)
        path = t.name.removesuffix(".weight")
        packed = path + ".scales" in self.names
        if t.role == "backbone":
            shape, size = tuple(t.array.shape), t.array.size
            plan.total_parameters += count_parameters(t.name, shape, size, tree)
        if packed or not t.name.endswith(".weight") or spec is None or tree is None:
            return Finish(cast)
        chosen, recorded = quant_decision(path, tree, spec, predicate)
        if chosen is None:
            return Finish(cast)
        if t.role == "backbone" and recorded is not None:
            plan.quant_overrides[path] = recorded
        return Finish(cast, chosen)

    def _cast_dtype(self, t: Tensor, dtype: str | None) -> mx.Dtype | None:
        """The output dtype of a tensor that is cast (the head's floats all, the backbone's
        as mlx-lm's cast_predicate says), else None."""
        cast = (
            dtype is not None
            and is_floating(t.array.dtype)
            and (t.role == "head" or self.cast_predicate(t.name))
        )
        return getattr(mx, dtype) if cast else None


def check_outputs(
    tree: ModuleTree, produced: dict[str, tuple[int, ...]], *, where: str, family: str, what: str
) -> None:
    """The outputs (name -> shape) must be exactly the parameters of `tree` (quantized
    modules may bring scales and biases), each of its shape unless packed."""
    unknown = []
    for name in produced:
        module, _, leaf = name.rpartition(".")
        if name in tree.params:
            continue
        if leaf in ("scales", "biases") and module in tree.quantizable:
            continue
        unknown.append(name)
    if unknown:
        names = sorted(unknown)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise MtpkitError(
            f"{len(names)} tensors in {where} are unknown to the {family} family "
            f"(mlx-lm's model has no such parameters): {shown}; "
            "mtpkit refuses rather than drop them"
        )
    missing = sorted(set(tree.params) - set(produced))
    if missing:
        raise MtpkitError(
            f"{where} lacks {len(missing)} tensors the {family} {what} needs: "
            f"{', '.join(missing[:5])}"
        )
    for name, shape in produced.items():
        expected = tree.params.get(name)
        packed = name.removesuffix(".weight") + ".scales" in produced
        if expected is not None and not packed and tuple(shape) != expected[0]:
            raise MtpkitError(
                f"{name} in {where} has shape {list(shape)}, the config implies "
                f"{list(expected[0])}: the config does not match the weights"
            )
