"""`mtpkit check`: one verdict on a published MTP checkpoint, for CI.

Two kinds of checks. Structural ones come from what `inspect` reads (config, index, manifest,
safetensors headers; the agreement rules are in `metadata.py`) plus one stock mlx-lm load of
the backbone for directories. Numeric probes run the head on short prompts as shipped and
under variants of its conventions (`probes.py` holds the variants and the diagnosis rule).
Reports: `output.py` prints, `junit.py` writes JUnit XML.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mtpkit.check.junit import junit_error_xml, write_junit
from mtpkit.check.measure import default_measure, model_moe_dtype, probe_directory, runnable_copy
from mtpkit.check.metadata import (
    manifest_problems,
    manifest_quantization_problems,
    quantization_problems,
)
from mtpkit.check.probes import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_ACCEPTANCE,
    FAIL,
    PASS,
    WARN,
    CheckResult,
    Diagnosis,
    MeasureFn,
    Measurement,
    shipped_variant,
)
from mtpkit.check.variants import SKIP
from mtpkit.checkpoint.inspect import UNREADABLE, Checkpoint, read_checkpoint, unread_mtp_shards
from mtpkit.checkpoint.validate import HEAD_NOT_FINITE, LAYER_COUNT_MISMATCH, nonfinite_tensors
from mtpkit.convert.destination import local_source_dir, refuse_inside
from mtpkit.core.config import INVALID_CONFIG
from mtpkit.core.errors import MtpkitError, more_of, one_line
from mtpkit.core.manifest import MANIFEST_FORMAT
from mtpkit.core.prompts import BUILTIN_PROMPTS, RESERVE_PROMPTS, read_prompts
from mtpkit.runtime.upcast import ExpertsTooLarge

# Stable check names, in report order (documented in README.md).
CHECKS = {
    "config": "config.json's values have the types and ranges the loaders need",
    "head_declared": "the config declares the MTP layers in the family's own field",
    "head_present": "the declared MTP tensors exist",
    "head_complete": "the head has every tensor (and expert) its family needs",
    "index": "the index, shards and headers agree",
    "quantization": "every quantized layer's scales/biases fit the bits and group size recorded for it",
    "manifest": "mtp/manifest.json is present and agrees with the tensors",
    "head_finite": "the head's weights hold no NaN or Inf (directories)",
    "backbone_loads": "stock mlx-lm loads the backbone (directories)",
    "acceptance": "greedy acceptance of the head as shipped reaches --min-acceptance",
    "norm_shift": "the head's RMSNorm weights are shifted exactly as the runtime expects",
    "hidden": "the head gets the hidden-state variant it was trained with",
    "concat_order": "the head's projection gets its two inputs in the trained order",
    "head_matches_trunk": "the head was trained with this trunk (some variant reaches --min-acceptance)",
}
# The checks the probes decide; reported as skipped when a structural check fails first.
PROBE_CHECKS = ("acceptance", "norm_shift", "hidden", "concat_order", "head_matches_trunk")


# --------------------------------------------------------------------------- structural


def structural_checks(ckpt: Checkpoint) -> list[CheckResult]:
    """Checks that need only what inspect read (no weights)."""
    return [
        _config(ckpt),
        _head_declared(ckpt),
        _head_present(ckpt),
        _head_complete(ckpt),
        _index(ckpt),
        _quantization(ckpt),
        _manifest(ckpt),
    ]


def _codes(ckpt: Checkpoint, *codes: str) -> list[str]:
    return [p["message"] for p in ckpt.problems if p["code"] in codes]


def _more(messages: list[str]) -> str:
    return messages[0] + more_of(messages)


def _config(ckpt: Checkpoint) -> CheckResult:
    messages = _codes(ckpt, INVALID_CONFIG)
    if messages:
        return CheckResult("config", FAIL, f"{_more(messages)}: fix config.json")
    return CheckResult("config", PASS, "the values mtpkit reads have valid types and ranges")


def _head_declared(ckpt: Checkpoint) -> CheckResult:
    family, mtp = ckpt.family, ckpt.mtp_tensors
    declared = family.declared_mtp_layers()
    field = family.mtp_field().rsplit(".", 1)[-1]
    invalid = [m for m in _codes(ckpt, INVALID_CONFIG) if f"{field}=" in m]
    if invalid or (invalid := _codes(ckpt, LAYER_COUNT_MISMATCH)):
        return CheckResult("head_declared", FAIL, invalid[0])
    if declared:
        return CheckResult("head_declared", PASS, f"{family.mtp_field()}={declared}")
    if mtp and not family.declared_upstream:
        # Qwen3-Next's and LongCat's HF configs have no such field; vLLM assumes one layer.
        return CheckResult(
            "head_declared", PASS, f"{family.name} has no config field; the head is found by name"
        )
    if mtp:
        return CheckResult(
            "head_declared",
            FAIL,
            f"{len(mtp)} MTP tensors exist but the config does not declare "
            f"{family.mtp_field()}: add it to config.json (or re-convert with `mtpkit convert`)",
        )
    # A dense decoder (Llama, Qwen3, ...) ships no head to convert: train one, as generate says.
    fix = (
        f"{family.name} models ship none: train one with `mtpkit train-head "
        f"{ckpt.source.describe()} -o OUT`"
        if not family.ships_head
        else "convert from the original repo with `mtpkit convert`"
    )
    return CheckResult(
        "head_declared",
        FAIL,
        f"the config declares no MTP layers ({family.mtp_field()}) and there are no MTP "
        f"tensors: not an MTP checkpoint; {fix}",
    )


def _unreadable(ckpt: Checkpoint, name: str) -> CheckResult | None:
    """A head that sits (or may sit) in a shard that could not be read is unknown, not absent."""
    unread = unread_mtp_shards(ckpt)
    if not unread:
        return None
    why = _codes(ckpt, *UNREADABLE)
    return CheckResult(
        name,
        FAIL,
        f"cannot tell: {', '.join(unread)} cannot be read ({_more(why)}); a damaged or "
        "incomplete download: download the files again",
    )


def _head_present(ckpt: Checkpoint) -> CheckResult:
    if (unknown := _unreadable(ckpt, "head_present")) is not None:
        return unknown
    mtp = ckpt.mtp_tensors
    missing = _codes(ckpt, "mtp_declared_not_present")
    if missing:
        return CheckResult("head_present", FAIL, missing[0])
    if not mtp:
        return CheckResult("head_present", FAIL, "no MTP tensors in the checkpoint")
    where = ", ".join(sorted({t.shard for t in mtp}))
    return CheckResult("head_present", PASS, f"{len(mtp)} MTP tensors in {where}")


def _head_complete(ckpt: Checkpoint) -> CheckResult:
    if (unknown := _unreadable(ckpt, "head_complete")) is not None:
        return unknown
    if not ckpt.mtp_tensors:
        return CheckResult("head_complete", FAIL, "no head to check")
    messages = _codes(ckpt, "incomplete_mtp", "incomplete_experts")
    if messages:
        return CheckResult(
            "head_complete",
            FAIL,
            f"{_more(messages)}: re-convert from the original repo, or re-graft with "
            "`mtpkit convert ORIGINAL --mtp-only --into DIR`",
        )
    if (mismatch := head_shape_problem(ckpt)) is not None:
        return CheckResult(
            "head_complete",
            FAIL,
            f"{mismatch}; the head is not this model's (another model's head?): graft the "
            "model's own with `mtpkit convert ORIGINAL --mtp-only --into DIR`",
        )
    return CheckResult("head_complete", PASS, "every required head tensor is present")


def head_shape_problem(ckpt: Checkpoint) -> str | None:
    """An MLX directory's head tensors against the head its config implies (names and
    shapes, from the headers, as convert checks them), so a head of another width fails here
    at once instead of in the probes. Raw checkpoints are checked when converted."""
    if ckpt.format != "mlx":
        return None
    from mtpkit.convert.plan import Converter, Settings, check_outputs

    family = ckpt.family
    try:
        tree = Converter(ckpt, Settings(), head_only=True).head_tree
        if tree is None:
            return None
        produced = {
            family.rename_head(t.name): tuple(t.shape)
            for t in ckpt.mtp_tensors
            if family.duplicate_of(t.name) is None
        }
        check_outputs(tree, produced, where="the head", family=family.name, what="head")
    except MtpkitError as e:
        return str(e).split(": the config does not match the weights")[0]
    return None


INDEX_CODES = (
    "missing_shard",
    "missing_tensor",
    "corrupt_header",
    "unsafe_path",
    "total_size_mismatch",
)


def _index(ckpt: Checkpoint) -> CheckResult:
    messages = _codes(ckpt, *INDEX_CODES)
    if messages:
        return CheckResult(
            "index",
            FAIL,
            f"{_more(messages)}: re-upload the missing or damaged files, or re-convert",
        )
    if ckpt.index is None:
        return CheckResult("index", PASS, f"no index; {len(ckpt.shards)} shard(s) read")
    return CheckResult(
        "index",
        PASS,
        f"{len(ckpt.index.get('weight_map', {}))} tensors in {len(ckpt.shards)} shard(s) agree",
    )


def _quantization(ckpt: Checkpoint) -> CheckResult:
    problems, count = quantization_problems(ckpt)
    problems += manifest_quantization_problems(ckpt)
    if problems:
        return CheckResult(
            "quantization",
            FAIL,
            f"{_more(problems)}: the loader would build the wrong layers; record the right "
            "per-path params in config.json's `quantization` or re-convert with `mtpkit convert`",
        )
    if not count:
        return CheckResult("quantization", PASS, "not quantized")
    head = sum(1 for t in ckpt.mtp_tensors if t.name.endswith(".scales"))
    return CheckResult(
        "quantization",
        PASS,
        f"{count} quantized layers ({head} in the head) fit their recorded params",
    )


def _manifest(ckpt: Checkpoint) -> CheckResult:
    if ckpt.format == "hf" and ckpt.manifest is None:
        return CheckResult(
            "manifest", PASS, "raw checkpoint: its conventions are the family's; no manifest needed"
        )
    if ckpt.manifest is None:
        if not ckpt.mtp_tensors:
            return CheckResult("manifest", WARN, "no manifest (and no head)")
        return CheckResult(
            "manifest",
            WARN,
            "no mtp/manifest.json: the norm shift and hidden variant are unrecorded and the "
            "runtime must assume them (the probes test them); `mtpkit convert` records them",
        )
    if not isinstance(ckpt.manifest, dict):
        return CheckResult("manifest", FAIL, "mtp/manifest.json is not a JSON object: re-convert")
    weights = ckpt.manifest.get("weights")
    if isinstance(weights, str) and not ckpt.source.has(f"mtp/{weights}"):
        return CheckResult(
            "manifest",
            FAIL,
            f"mtp/manifest.json names the head file mtp/{weights}, which is missing: copy it "
            "back, or re-convert with `mtpkit convert`",
        )
    problems = manifest_problems(ckpt)
    if problems:
        return CheckResult(
            "manifest",
            FAIL,
            f"{_more(problems)}: the runtime trusts the manifest; re-convert with `mtpkit convert`",
        )
    if ckpt.manifest.get("format") != MANIFEST_FORMAT:
        return CheckResult(
            "manifest", WARN, f"manifest from another tool (format {ckpt.manifest.get('format')!r})"
        )
    fmt = ckpt.manifest.get("rmsnorm_weight_format", "?")
    return CheckResult(
        "manifest",
        PASS,
        f"{ckpt.manifest.get('family')}, norms {fmt}, hidden {ckpt.manifest.get('hidden', '?')}, "
        f"{ckpt.manifest.get('concat_order', '?')}",
    )


def head_finite_check(root: Path, ckpt: Checkpoint) -> CheckResult:
    """Read the head's tensors from a local copy: NaN or Inf fails it before any probe."""
    files: dict[Path, list[str]] = {}
    for t in ckpt.mtp_tensors:
        files.setdefault(root / t.shard, []).append(t.name)
    bad = list(nonfinite_tensors(files))
    if bad:
        return CheckResult(
            "head_finite",
            FAIL,
            f"{HEAD_NOT_FINITE}: {_more(bad)} hold NaN or Inf; the head's weights are damaged "
            "(a bad download or a broken conversion): download again or re-convert from the "
            "original with `mtpkit convert`",
        )
    return CheckResult("head_finite", PASS, f"{len(ckpt.mtp_tensors)} head tensors are finite")


def backbone_check(model_dir: Path, ckpt: Checkpoint | None = None) -> CheckResult:
    """Load the backbone with stock mlx-lm (lazily: names, shapes and layers, no compute).

    An MLX directory must load exactly as published. A raw checkpoint's MTP tensors are
    set aside first: stock mlx-lm drops them for some families and not for others
    (DeepSeek's nextn layer), and `mtpkit convert` moves them out of the model files anyway.
    """
    from mlx_lm.utils import load_model

    from mtpkit.runtime.model import model_classes_without

    # A raw checkpoint's head tensors are named by its family; an MLX directory drops none.
    family = ckpt.family if ckpt is not None and ckpt.format == "hf" else None

    def get_classes(config: dict[str, Any]) -> tuple[type, type]:
        return model_classes_without(config, family.is_mtp_tensor if family else lambda _: False)

    try:
        load_model(Path(model_dir), lazy=True, get_model_classes=get_classes)
    except Exception as e:  # noqa: BLE001 - any loader failure is the finding
        text = " ".join(str(e).split())
        return CheckResult(
            "backbone_loads",
            FAIL,
            f"stock mlx-lm cannot load it: {type(e).__name__}: {text[:300]}; re-convert with "
            "`mtpkit convert`",
        )
    return CheckResult("backbone_loads", PASS, "stock mlx-lm loads the backbone")


# --------------------------------------------------------------------------- the whole check


def check_checkpoint(
    source: str,
    *,
    revision: str | None = None,
    probe: bool | None = None,
    prompts: Sequence[str] | None = None,
    prompts_file: str | Path | None = None,
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    measure: MeasureFn | None = None,
    junit: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Check a checkpoint and return the `check --json` object.

    `probe=None` probes directories and skips Hub repos (which would need a download). A
    check that fails makes the verdict `fail`; a warning does not. `prompts_file` (see
    `read_prompts`) replaces `prompts`. With `junit`, a JUnit report is written there, also
    when the check cannot run (then the error is re-raised).
    """
    if junit is not None:  # before anything runs: no report, not even an error's, goes there
        refuse_inside(Path(junit), [local_source_dir(source)], option="--junit")
    try:
        if prompts_file is not None:
            prompts = read_prompts(prompts_file)
        result = _check(
            source,
            revision=revision,
            probe=probe,
            prompts=prompts,
            min_acceptance=min_acceptance,
            max_tokens=max_tokens,
            measure=measure,
            log=log or (lambda message: None),
        )
    except Exception as e:
        if junit is not None:  # CI shows why the check could not run
            error = junit_error_xml(source, revision, one_line(e), type(e).__name__)
            write_junit(error, junit, source)
        raise
    if junit is not None:
        write_junit(result, junit, source)
    return result


def _check(
    source: str,
    *,
    revision: str | None,
    probe: bool | None,
    prompts: Sequence[str] | None,
    min_acceptance: float,
    max_tokens: int,
    measure: MeasureFn | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    ckpt = read_checkpoint(source, revision=revision)
    checks = structural_checks(ckpt)
    is_local = ckpt.source.kind == "local"
    if probe is None and not is_local:
        log("Hub repo: structural checks only; pass --probe to download it and measure acceptance")
    probe = is_local if probe is None else probe
    # Reserve prompts settle undecided comparisons; a user's own prompts are used as given.
    reserve = list(RESERVE_PROMPTS) if prompts is None else []
    prompts = list(prompts) if prompts is not None else list(BUILTIN_PROMPTS)
    if not prompts:
        raise MtpkitError("no prompts to probe with: pass a non-empty --prompts FILE")
    if is_local:
        if ckpt.mtp_tensors and all(c.status != FAIL for c in checks):
            checks.append(head_finite_check(Path(ckpt.source.root), ckpt))
        checks.append(backbone_check(Path(ckpt.source.root), ckpt))
    diagnosis: Diagnosis | None = None
    moe_dtype: str | None = None
    skipped: list[CheckResult] = []
    if probe and any(c.status == FAIL for c in checks):
        log("probes skipped: a structural check failed")
        checks.extend(skipped_probes(checks))
    elif probe:
        with runnable_copy(ckpt, log=log) as model_dir:
            if not is_local and ckpt.format == "mlx":
                checks.append(head_finite_check(model_dir, ckpt))
                checks.append(backbone_check(model_dir))
            if all(c.status != FAIL for c in checks):
                moe_dtype, skipped = _load_for_probes(model_dir, measure)
                checks.extend(skipped)
            if all(c.status != FAIL for c in checks) and not skipped:
                diagnosis = probe_directory(
                    model_dir,
                    shipped_variant(ckpt.manifest, ckpt.family.concat_order),
                    prompts,
                    measure=measure or default_measure(),
                    reserve=reserve,
                    min_acceptance=min_acceptance,
                    max_tokens=max_tokens,
                    zero_centred=ckpt.family.zero_centred_norms,
                    log=log,
                )
                checks.extend(diagnosis.checks)
    return {
        "source": ckpt.source.spec,
        "revision": ckpt.source.revision,
        "verdict": FAIL if any(c.status == FAIL for c in checks) else PASS,
        "checks": [c.to_json() for c in checks],
        "acceptance": round(diagnosis.acceptance, 4) if diagnosis else None,
        "best_variant": best_variant(diagnosis.best) if diagnosis else None,
        "moe_dtype": moe_dtype,
    }


def skipped_probes(checks: list[CheckResult]) -> list[CheckResult]:
    """Each probe check as skipped, naming the structural checks that failed (CI dashboards
    keep seeing every case)."""
    failed = ", ".join(c.name for c in checks if c.status == FAIL)
    return [
        CheckResult(name, SKIP, f"not run: structural check(s) failed first ({failed})")
        for name in PROBE_CHECKS
    ]


def _load_for_probes(
    model_dir: Path, measure: MeasureFn | None
) -> tuple[str | None, list[CheckResult]]:
    """The runtime's load, once before the probes: the experts' dtype, or why no probe runs.

    Where the float32 experts MLX's CPU backend needs would not fit in memory, the probes are
    skipped with a warning naming `moe_float32_exceeds_memory`: the structural checks decide.
    A caller's own `measure` loads nothing here.
    """
    if measure is not None:
        return None, []
    try:
        return model_moe_dtype(model_dir), []
    except ExpertsTooLarge as e:
        return None, [CheckResult("acceptance", WARN, f"probes skipped: {e}")]


def best_variant(best: Measurement) -> dict[str, Any]:
    """The `best_variant` object of `check --json`."""
    v = best.variant
    return {
        "norm_shift": v.norm_shift,
        "hidden": v.hidden,
        "concat_order": v.concat_order,
        "acceptance": round(best.acceptance, 4),
    }
