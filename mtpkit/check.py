"""`mtpkit check`: one verdict on a published MTP checkpoint, for CI.

Two kinds of checks. Structural ones come from what `inspect` reads (config, index, manifest,
safetensors headers) plus one stock mlx-lm load of the backbone for directories. Numeric probes
generate greedily with the head on short prompts and measure acceptance as shipped, then under
variants (norms shifted by -1 and +1, the other hidden-state variant, the other concat order),
so a double or missing norm shift or a mismatched convention is named with its fix.

The verdict rule (see `VARIANT_RULES`, and README.md for why each margin is safe): a variant
fails the head as shipped when it makes the head usable (reaches --min-acceptance) and gains at
least its margin, at `SIGNIFICANCE_Z` standard errors of the paired per-prompt differences; for
norms -1 on zero-centred families, keeping half the shipped acceptance is enough, because a
correctly shifted head collapses without its +1. Greedy verification is lossless, so every
variant is scored on the same backbone text and the comparison is paired, prompt by prompt.
Undecided gains are measured again on reserve prompts. When no single variant rescues the
head, every combination is tried before the head is blamed on the trunk.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.errors import MtpkitError
from mtpkit.families import family_for
from mtpkit.families.base import expert_layout
from mtpkit.inspect import Checkpoint, read_checkpoint
from mtpkit.manifest import MANIFEST_FORMAT, PLAIN, SHIFTED, UNSHIFTED
from mtpkit.prompts import BUILTIN_PROMPTS, RESERVE_PROMPTS

PASS, WARN, FAIL = "pass", "warn", "fail"

# Stable check names, in report order (documented in README.md).
CHECKS = {
    "head_declared": "the config declares the MTP layers in the family's own field",
    "head_present": "the declared MTP tensors exist",
    "head_complete": "the head has every tensor (and expert) its family needs",
    "index": "the index, shards and headers agree",
    "quantization": "every quantized layer's scales/biases fit the bits and group size recorded for it",
    "manifest": "mtp/manifest.json is present and agrees with the tensors",
    "backbone_loads": "stock mlx-lm loads the backbone (directories)",
    "acceptance": "greedy acceptance of the head as shipped reaches --min-acceptance",
    "norm_shift": "the head's RMSNorm weights are shifted exactly as the runtime expects",
    "hidden": "the head gets the hidden-state variant it was trained with",
    "concat_order": "the head's projection gets its two inputs in the trained order",
    "head_matches_trunk": "the head was trained with this trunk (some variant reaches --min-acceptance)",
}

HIDDEN_VARIANTS = ("post_norm", "pre_norm")
CONCAT_ORDERS = ("embedding_first", "hidden_first")
# What the runtime feeds the head when a checkpoint records nothing (vLLM/transformers default).
DEFAULT_HIDDEN = "post_norm"

DEFAULT_MIN_ACCEPTANCE = 0.2
DEFAULT_MAX_TOKENS = 48
# Standard errors a variant's mean per-prompt gain must clear (one-sided p < 0.002 under a
# normal approximation), so noise on a healthy head never reads as a convention error.
SIGNIFICANCE_Z = 3.0


@dataclass(frozen=True)
class VariantRule:
    """When a single-convention variant fails (or warns about) the head as shipped.

    A variant fails the check when it makes the head usable (reaches --min-acceptance) and
    either gains at least `fail_margin` over the shipped head, significantly (`SIGNIFICANCE_Z`
    standard errors of the paired per-prompt differences), or, where `keep_fraction` is set,
    keeps at least that fraction of the shipped acceptance.
    """

    check: str
    fail_margin: float
    warn_margin: float
    keep_fraction: float | None = None


# Margins in acceptance (0..1). Each is safe because of what the variant does to a healthy head.
# Figures: the trained example (`mtpkit check mtpkit/examples/tiny-qwen3_5`), 72% as shipped.
VARIANT_RULES = {
    # Taking +1 off a correctly shifted head's norms is exactly the missing-shift failure: the
    # head collapses (0.0% on the example). So a head that keeps even half its acceptance
    # without one +1 carries an extra +1. This does not depend on what the double shift costs,
    # which can be only a few points (RMSNorm is nearly scale-free; 11 points on the example)
    # and then is hard to tell from noise on a few prompts.
    "norm_shift=-1": VariantRule("norm_shift", 0.01, 0.01, keep_fraction=0.5),
    # On a healthy head, +1 is a double shift: some points down (61% on the example), or up by
    # chance. A missing shift collapses the head, so a real one gains tens of points.
    "norm_shift=+1": VariantRule("norm_shift", 0.05, 0.05),
    # Swapped projection inputs collapse a head (7% on the example); a real mismatch gains
    # tens of points.
    "concat_order": VariantRule("concat_order", 0.05, 0.05),
    # Both hidden-state variants are in use and a head tolerates the other one at a cost of a
    # few points (80.3% vs 75.2% on Qwen3.6-27B; 69.6% vs 72.2% on the example), so a gain
    # under 5 points only warns.
    "hidden": VariantRule("hidden", 0.05, 0.02),
}


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass(frozen=True)
class Variant:
    """Runtime settings a probe runs the head with."""

    norm_shift: int
    hidden: str
    concat_order: str

    def describe(self) -> str:
        shift = f"norms {self.norm_shift:+d}" if self.norm_shift else "norms as shipped"
        return f"{shift}, {self.hidden}, {self.concat_order}"


@dataclass
class Measurement:
    variant: Variant
    per_prompt: list[float]

    @property
    def acceptance(self) -> float:
        return statistics.fmean(self.per_prompt) if self.per_prompt else 0.0


@dataclass
class Comparison:
    """A variant's paired gain over the shipped head."""

    key: str
    measurement: Measurement
    gain: float
    stderr: float

    def clears(self, margin: float) -> bool:
        return self.gain >= margin and self.gain >= SIGNIFICANCE_Z * self.stderr


# measure(model_dir, prompts, *, max_tokens, hidden, concat_order, norm_shift) -> acceptance
MeasureFn = Callable[..., float]


# --------------------------------------------------------------------------- structural


def structural_checks(ckpt: Checkpoint) -> list[CheckResult]:
    """Checks that need only what inspect read (no weights)."""
    return [
        _head_declared(ckpt),
        _head_present(ckpt),
        _head_complete(ckpt),
        _index(ckpt),
        _quantization(ckpt),
        _manifest(ckpt),
    ]


def _codes(ckpt: Checkpoint, *codes: str) -> list[str]:
    return [p["message"] for p in ckpt.problems if p["code"] in codes]


def _head_declared(ckpt: Checkpoint) -> CheckResult:
    family, mtp = ckpt.family, ckpt.mtp_tensors
    declared = family.declared_mtp_layers()
    if declared:
        return CheckResult("head_declared", PASS, f"{family.mtp_field()}={declared}")
    if mtp and family.name == "qwen3_next":
        # Qwen3-Next's HF config has no such field; vLLM assumes one layer.
        return CheckResult(
            "head_declared", PASS, "qwen3_next has no config field; the head is found by name"
        )
    if mtp:
        return CheckResult(
            "head_declared",
            FAIL,
            f"{len(mtp)} MTP tensors exist but the config does not declare "
            f"{family.mtp_field()}: add it to config.json (or re-convert with `mtpkit convert`)",
        )
    return CheckResult(
        "head_declared",
        FAIL,
        f"the config declares no MTP layers ({family.mtp_field()}) and there are no MTP "
        "tensors: not an MTP checkpoint; convert from the original repo with `mtpkit convert`",
    )


def _head_present(ckpt: Checkpoint) -> CheckResult:
    mtp = ckpt.mtp_tensors
    missing = _codes(ckpt, "mtp_declared_not_present")
    if missing:
        return CheckResult("head_present", FAIL, missing[0])
    if not mtp:
        return CheckResult("head_present", FAIL, "no MTP tensors in the checkpoint")
    where = ", ".join(sorted({t.shard for t in mtp}))
    return CheckResult("head_present", PASS, f"{len(mtp)} MTP tensors in {where}")


def _head_complete(ckpt: Checkpoint) -> CheckResult:
    if not ckpt.mtp_tensors:
        return CheckResult("head_complete", FAIL, "no head to check")
    messages = _codes(ckpt, "incomplete_mtp", "incomplete_experts")
    if messages:
        more = f" (+{len(messages) - 1} more)" if len(messages) > 1 else ""
        return CheckResult(
            "head_complete",
            FAIL,
            f"{messages[0]}{more}: re-convert from the original repo, or re-graft with "
            "`mtpkit convert ORIGINAL --mtp-only --into DIR`",
        )
    return CheckResult("head_complete", PASS, "every required head tensor is present")


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
        more = f" (+{len(messages) - 1} more)" if len(messages) > 1 else ""
        return CheckResult(
            "index",
            FAIL,
            f"{messages[0]}{more}: re-upload the missing or damaged files, or re-convert",
        )
    if ckpt.index is None:
        return CheckResult("index", PASS, f"no index; {len(ckpt.shards)} shard(s) read")
    return CheckResult(
        "index",
        PASS,
        f"{len(ckpt.index.get('weight_map', {}))} tensors in {len(ckpt.shards)} shard(s) agree",
    )


# -- quantization -------------------------------------------------------------------------

# (group_size, bits) mlx-lm assumes for a mode that records neither.
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
QUANT_PARAM_KEYS = ("group_size", "bits", "mode")


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` dict (top level, or mirrored in `quantization_config`)."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and "quant_method" not in q and ("bits" in q or "group_size" in q):
            return q
    return None


def _layer_params(q: dict[str, Any] | None, path: str) -> dict[str, Any] | bool | None:
    """The params mlx-lm's loader uses for `path`: an override, False, or the default."""
    if q is None:
        return None
    override = q.get(path)
    if override is False:
        return False
    base = dict(q) if not isinstance(override, dict) else {**q, **override}
    mode = base.get("mode", "affine")
    group, bits = MODE_DEFAULTS.get(mode, (64, 4))
    return {
        "group_size": int(base.get("group_size") or group),
        "bits": int(base.get("bits") or bits),
        "mode": mode,
    }


def _fits(weight_cols: int, scale_cols: int) -> str:
    """The (bits, group_size) pairs a packed weight and its scales are consistent with."""
    fits = [
        f"{bits} bits/group {group}"
        for bits in (2, 3, 4, 5, 6, 8)
        for group in (32, 64, 128)
        if weight_cols * 32 % bits == 0 and weight_cols * 32 // bits == scale_cols * group
    ]
    return " or ".join(fits[:3]) if fits else "no standard bits/group size"


def quantization_problems(ckpt: Checkpoint) -> tuple[list[str], int]:
    """Layers whose packed weight, scales and biases do not fit their recorded params."""
    q = quantization_config(ckpt.config)
    tensors = ckpt.tensors
    layers = sorted(n.removesuffix(".scales") for n in tensors if n.endswith(".scales"))
    problems: list[str] = []
    for name, t in sorted(tensors.items()):
        if (
            name.endswith(".weight")
            and t.dtype == "U32"
            and f"{name.removesuffix('.weight')}.scales" not in tensors
        ):
            problems.append(f"{name} is packed (uint32) but has no .scales")
    if layers and q is None:
        problems.append(
            f"{len(layers)} layers are quantized (first: {layers[0]}) but config.json has no "
            "`quantization` entry"
        )
        return problems, len(layers)
    for path in layers:
        params = _layer_params(q, path)
        weight, scales = tensors.get(f"{path}.weight"), tensors[f"{path}.scales"]
        biases = tensors.get(f"{path}.biases")
        if params is False:
            problems.append(f"config.json says {path} is not quantized, but it has .scales")
            continue
        assert isinstance(params, dict)
        bits, group, mode = params["bits"], params["group_size"], params["mode"]
        if weight is None:
            problems.append(f"{path}.scales has no {path}.weight")
            continue
        if weight.dtype != "U32":
            problems.append(f"{path}.weight is {weight.dtype}, not packed uint32, but has .scales")
            continue
        if mode == "affine" and biases is None:
            problems.append(f"{path} is affine-quantized but has no .biases")
        if biases is not None and biases.shape != scales.shape:
            problems.append(
                f"{path}.biases {list(biases.shape)} differs from .scales {list(scales.shape)}"
            )
        if weight.shape[:-1] != scales.shape[:-1] or not weight.shape:
            problems.append(
                f"{path}.weight {list(weight.shape)} and .scales {list(scales.shape)} disagree on rows"
            )
            continue
        in_from_weight = weight.shape[-1] * 32 / bits
        in_from_scales = scales.shape[-1] * group
        if in_from_weight != in_from_scales:
            override = "its override" if isinstance(q.get(path), dict) else "the config default"
            problems.append(
                f"{path}: weight {list(weight.shape)} with scales {list(scales.shape)} fits "
                f"{_fits(weight.shape[-1], scales.shape[-1])}, but {override} says {bits} bits/"
                f"group {group}"
            )
    if q is not None:
        for path, override in q.items():
            if path in QUANT_PARAM_KEYS or not isinstance(override, dict):
                continue
            w = tensors.get(f"{path}.weight")
            if w is not None and f"{path}.scales" not in tensors:
                problems.append(
                    f"config.json quantizes {path} ({override.get('bits')} bits) but its weight is {w.dtype} with no .scales"
                )
    return problems, len(layers)


def _quantization(ckpt: Checkpoint) -> CheckResult:
    problems, count = quantization_problems(ckpt)
    problems += manifest_quantization_problems(ckpt)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(
            "quantization",
            FAIL,
            f"{problems[0]}{more}: the loader would build the wrong layers; record the right "
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


# -- manifest -----------------------------------------------------------------------------


def _head_bits(ckpt: Checkpoint) -> set[int]:
    q = quantization_config(ckpt.config)
    bits = set()
    for t in ckpt.mtp_tensors:
        if t.name.endswith(".scales"):
            params = _layer_params(q, t.name.removesuffix(".scales"))
            if isinstance(params, dict):
                bits.add(params["bits"])
    return bits


def manifest_quantization_problems(ckpt: Checkpoint) -> list[str]:
    """Where the manifest's record of the head's quantization disagrees with the tensors."""
    m = ckpt.manifest if isinstance(ckpt.manifest, dict) else {}
    if m.get("format") not in (None, MANIFEST_FORMAT):
        return []
    mtp = ckpt.mtp_tensors
    problems: list[str] = []
    quantized = any(t.name.endswith(".scales") for t in mtp)
    if "mtp_quantization" in m and mtp:
        mq = m["mtp_quantization"]
        if not mq and quantized:
            problems.append("manifest says the head is not quantized but its tensors carry .scales")
        elif isinstance(mq, dict) and mq.get("bits") and not quantized:
            problems.append(
                f"manifest says the head is {mq['bits']}-bit but its tensors are not quantized"
            )
        elif isinstance(mq, dict) and mq.get("bits") and quantized:
            bits = _head_bits(ckpt)
            if bits and int(mq["bits"]) not in bits:
                problems.append(
                    f"manifest says the head is {mq['bits']}-bit but the config quantizes it at {sorted(bits)}"
                )
    paths = m.get("mtp_quantization_paths")
    if isinstance(paths, dict) and mtp:
        q = quantization_config(ckpt.config) or {}
        names = {t.name for t in mtp}
        for path, params in sorted(paths.items()):
            if f"{path}.weight" not in names:
                continue
            has_scales = f"{path}.scales" in names
            if bool(params) != has_scales:
                state = "quantized" if params else "not quantized"
                problems.append(
                    f"manifest says {path} is {state} but its tensors {'carry' if has_scales else 'lack'} .scales"
                )
            elif isinstance(params, dict) and isinstance(q.get(path), dict):
                recorded = {k: q[path].get(k) for k in ("bits", "group_size")}
                if recorded != {k: params.get(k) for k in ("bits", "group_size")}:
                    problems.append(
                        f"manifest quantizes {path} as {params} but config.json says {q[path]}"
                    )
    return problems


def manifest_problems(ckpt: Checkpoint) -> list[str]:
    """Where `mtp/manifest.json` disagrees with the tensors or the config."""
    m = ckpt.manifest or {}
    mtp = ckpt.mtp_tensors
    problems: list[str] = []
    if m.get("format") not in (None, MANIFEST_FORMAT):
        return problems  # another tool's manifest: only the norm format is shared
    family = m.get("family")
    if family is not None:
        try:
            recorded = family_for({"model_type": family}).name
        except MtpkitError:
            recorded = str(family)
        if recorded != ckpt.family.name:
            problems.append(
                f"manifest family {family!r} but config model_type is {ckpt.family.name!r}"
            )
    prefix = m.get("prefix")
    if prefix and mtp:
        outside = [t.name for t in mtp if not t.name.startswith(prefix)]
        if outside:
            problems.append(
                f"manifest prefix {prefix!r} but head tensor {outside[0]} lies outside it"
            )
    layers, declared = m.get("num_layers"), ckpt.family.declared_mtp_layers()
    if layers is not None and declared is not None and int(layers) != declared:
        problems.append(f"manifest num_layers={layers} but the config declares {declared}")
    fmt = m.get("rmsnorm_weight_format")
    if fmt is not None and fmt not in (SHIFTED, UNSHIFTED, PLAIN):
        problems.append(
            f"manifest rmsnorm_weight_format {fmt!r} is not one of {SHIFTED}, {UNSHIFTED}, {PLAIN}"
        )
    if fmt == PLAIN and ckpt.family.zero_centred_norms:
        problems.append(f"manifest says plain norms but {ckpt.family.name} norms are zero-centred")
    if m.get("hidden") is not None and m["hidden"] not in HIDDEN_VARIANTS:
        problems.append(
            f"manifest hidden {m['hidden']!r} is not one of {', '.join(HIDDEN_VARIANTS)}"
        )
    if m.get("concat_order") is not None and m["concat_order"] not in CONCAT_ORDERS:
        problems.append(
            f"manifest concat_order {m['concat_order']!r} is not one of {', '.join(CONCAT_ORDERS)}"
        )
    problems.extend(manifest_quantization_problems(ckpt))
    layout = m.get("expert_layout")
    if isinstance(layout, dict):
        layout = layout.get("after", layout.get("output"))
    if isinstance(layout, str) and mtp:
        actual = expert_layout(t.name for t in mtp if ckpt.family.duplicate_of(t.name) is None)
        if actual not in (None, layout):
            problems.append(
                f"manifest expert_layout {layout!r} but the head's experts are {actual!r}"
            )
    return problems


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
    problems = manifest_problems(ckpt)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(
            "manifest",
            FAIL,
            f"{problems[0]}{more}: the runtime trusts the manifest; re-convert with `mtpkit convert`",
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


def backbone_check(model_dir: Path, ckpt: Checkpoint | None = None) -> CheckResult:
    """Load the backbone with stock mlx-lm (lazily: names, shapes and layers, no compute).

    An MLX directory must load exactly as published. A raw checkpoint's MTP tensors are
    set aside first: stock mlx-lm drops them for some families and not for others
    (DeepSeek's nextn layer), and `mtpkit convert` moves them out of the model files anyway.
    """
    from mlx_lm.utils import _get_classes, load_model

    get_classes = _get_classes
    if ckpt is not None and ckpt.format == "hf":
        family = ckpt.family

        def get_classes(config: dict[str, Any]) -> tuple[type, type]:
            model_class, args_class = _get_classes(config)

            class WithoutHead(model_class):  # type: ignore[misc, valid-type]
                def sanitize(self, weights: dict[str, Any]) -> dict[str, Any]:
                    weights = {k: v for k, v in weights.items() if not family.is_mtp_tensor(k)}
                    sanitize = getattr(super(), "sanitize", None)
                    return sanitize(weights) if sanitize else weights

            return WithoutHead, args_class

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


# --------------------------------------------------------------------------- probes


def shipped_variant(ckpt: Checkpoint) -> Variant:
    """What the runtime runs the head with: the manifest's record, else the family's default."""
    m = ckpt.manifest if isinstance(ckpt.manifest, dict) else {}
    hidden = m.get("hidden") if m.get("hidden") in HIDDEN_VARIANTS else DEFAULT_HIDDEN
    order = (
        m.get("concat_order")
        if m.get("concat_order") in CONCAT_ORDERS
        else ckpt.family.concat_order
    )
    return Variant(0, hidden, order)


def _other(value: str, pair: tuple[str, str]) -> str:
    return pair[1] if value == pair[0] else pair[0]


def single_variants(shipped: Variant) -> dict[str, Variant]:
    """The four one-convention changes the diagnosis tries, keyed as in VARIANT_RULES."""
    return {
        "norm_shift=-1": Variant(-1, shipped.hidden, shipped.concat_order),
        "norm_shift=+1": Variant(1, shipped.hidden, shipped.concat_order),
        "hidden": Variant(0, _other(shipped.hidden, HIDDEN_VARIANTS), shipped.concat_order),
        "concat_order": Variant(0, shipped.hidden, _other(shipped.concat_order, CONCAT_ORDERS)),
    }


def all_variants(shipped: Variant) -> list[Variant]:
    """Every combination, for a head that no single change rescues."""
    return [
        Variant(shift, hidden, order)
        for shift in (0, -1, 1)
        for hidden in (shipped.hidden, _other(shipped.hidden, HIDDEN_VARIANTS))
        for order in (shipped.concat_order, _other(shipped.concat_order, CONCAT_ORDERS))
    ]


def compare(shipped: Measurement, other: Measurement, key: str = "") -> Comparison:
    """Paired per-prompt gain of `other` over `shipped`, with its standard error.

    Reserve prompts are appended after the built-in ones, so when only one side was measured
    on them the pairs are the prompts both saw.
    """
    diffs = [b - a for a, b in zip(shipped.per_prompt, other.per_prompt, strict=False)]
    gain = statistics.fmean(diffs) if diffs else 0.0
    stderr = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return Comparison(key, other, gain, stderr)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _fix(shipped: Variant, best: Variant) -> str:
    """What makes the runtime use `best` for good."""
    parts = []
    if best.norm_shift:
        parts.append(
            "re-convert from the original checkpoint with `mtpkit convert ORIGINAL -o OUT` (it "
            "shifts the norms exactly once and records it), or re-graft the head with "
            "`mtpkit convert ORIGINAL --mtp-only --into DIR`"
        )
    if best.concat_order != shipped.concat_order:
        parts.append(
            f'the head was trained with concat_order {best.concat_order}: record "concat_order": '
            f'"{best.concat_order}" in mtp/manifest.json (the runtime reads it), or re-convert '
            "from the original checkpoint with `mtpkit convert ORIGINAL -o OUT`"
        )
    if best.hidden != shipped.hidden:
        parts.append(
            f"re-convert with `mtpkit convert ORIGINAL -o OUT --hidden {best.hidden}` (or record "
            f'"hidden": "{best.hidden}" in mtp/manifest.json; `mtpkit generate --hidden '
            f"{best.hidden}` for one run)"
        )
    return "; ".join(parts)


@dataclass
class Diagnosis:
    checks: list[CheckResult]
    acceptance: float
    best: Measurement
    measurements: list[Measurement] = field(default_factory=list)


def diagnose(
    measure_variant: Callable[[Variant], Measurement],
    shipped: Variant,
    *,
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
    zero_centred: bool = True,
    measure_more: Callable[[Variant], Measurement] | None = None,
) -> Diagnosis:
    """Run the shipped head and its variants, and turn the numbers into checks (the rule).

    `measure_more` measures a variant on reserve prompts: when a variant's gain reaches its
    margin but not significance, the shipped head and that variant are measured on them too
    and compared over all prompts, before anything is called inconclusive.
    """
    base = measure_variant(shipped)
    comparisons = {
        key: compare(base, measure_variant(v), key) for key, v in single_variants(shipped).items()
    }
    measurements = [base] + [c.measurement for c in comparisons.values()]
    undecided = [
        c
        for c in comparisons.values()
        if c.gain >= VARIANT_RULES[c.key].warn_margin
        and not c.clears(VARIANT_RULES[c.key].warn_margin)
        and c.measurement.acceptance >= min_acceptance
    ]
    if undecided and measure_more is not None:
        more = measure_more(shipped)
        base = Measurement(shipped, base.per_prompt + more.per_prompt)
        measurements[0] = base
        for c in undecided:
            extra = measure_more(c.measurement.variant)
            joined = Measurement(c.measurement.variant, c.measurement.per_prompt + extra.per_prompt)
            comparisons[c.key] = compare(base, joined, c.key)
            measurements[measurements.index(c.measurement)] = joined
    checks: list[CheckResult] = []

    a0 = base.acceptance
    n = len(base.per_prompt)
    if a0 >= min_acceptance:
        checks.append(
            CheckResult(
                "acceptance",
                PASS,
                f"{_pct(a0)} as shipped over {n} prompts (minimum {_pct(min_acceptance)})",
            )
        )
    else:
        checks.append(
            CheckResult(
                "acceptance",
                FAIL,
                f"{_pct(a0)} as shipped over {n} prompts, below the minimum {_pct(min_acceptance)}",
            )
        )

    winners: list[Comparison] = []
    for check in ("norm_shift", "hidden", "concat_order"):
        keys = [k for k, r in VARIANT_RULES.items() if r.check == check]
        cs = [comparisons[k] for k in keys]
        # A variant is named as the fix only if it makes the head usable: gains among
        # variants that all stay below the minimum are noise around a head that never worked.
        failing = [c for c in cs if _fails(c, a0, min_acceptance, zero_centred)]
        warning = [c for c in cs if c.clears(VARIANT_RULES[c.key].warn_margin)]
        summary = ", ".join(f"{_describe_key(c.key)} {_pct(c.measurement.acceptance)}" for c in cs)
        if failing:
            c = max(failing, key=lambda c: c.gain)
            winners.append(c)
            checks.append(
                CheckResult(
                    check,
                    FAIL,
                    f"{_verdict_words(c.key)}: {_pct(a0)} as shipped, {_pct(c.measurement.acceptance)} "
                    f"with {_describe_key(c.key)} ({_signed_pct(c.gain)} ± {_pct(c.stderr)})"
                    f"{_why(c, a0)}; fix: {_fix(shipped, c.measurement.variant)}",
                )
            )
        elif warning:
            c = max(warning, key=lambda c: c.gain)
            checks.append(
                CheckResult(
                    check,
                    WARN,
                    f"{_describe_key(c.key)} gains {_pct(c.gain)} ± {_pct(c.stderr)} "
                    f"({_pct(c.measurement.acceptance)} vs {_pct(a0)}), under the "
                    f"{_pct(VARIANT_RULES[c.key].fail_margin)} that fails; consider: "
                    f"{_fix(shipped, c.measurement.variant)}",
                )
            )
        else:
            inconclusive = [
                c
                for c in cs
                if c.gain >= VARIANT_RULES[c.key].warn_margin
                and not c.clears(VARIANT_RULES[c.key].warn_margin)
                and c.measurement.acceptance >= min_acceptance
            ]
            if inconclusive:
                c = inconclusive[0]
                checks.append(
                    CheckResult(
                        check,
                        WARN,
                        f"inconclusive: {_describe_key(c.key)} gains {_pct(c.gain)} ± "
                        f"{_pct(c.stderr)}; probe more prompts with --prompts FILE",
                    )
                )
            else:
                checks.append(CheckResult(check, PASS, f"as shipped {_pct(a0)}; {summary}"))

    # The variant the verdict settles on: the biggest winner, else what was shipped.
    best = max((c.measurement for c in winners), key=lambda m: m.acceptance, default=base)
    if winners and len(winners) > 1:
        combined = Variant(
            next(
                (c.measurement.variant.norm_shift for c in winners if c.key.startswith("norm")), 0
            ),
            next(
                (c.measurement.variant.hidden for c in winners if c.key == "hidden"), shipped.hidden
            ),
            next(
                (c.measurement.variant.concat_order for c in winners if c.key == "concat_order"),
                shipped.concat_order,
            ),
        )
        joint = measure_variant(combined)
        measurements.append(joint)
        if joint.acceptance > best.acceptance:
            best = joint

    if max(m.acceptance for m in measurements) < min_acceptance:
        # No single change rescues the head: try every combination before blaming the trunk.
        tried = {m.variant for m in measurements}
        for v in all_variants(shipped):
            if v not in tried:
                measurements.append(measure_variant(v))
        top = max(measurements, key=lambda m: m.acceptance)
        if top.acceptance >= min_acceptance and compare(base, top).clears(
            VARIANT_RULES["norm_shift=+1"].fail_margin
        ):
            best = top
            checks.append(
                CheckResult(
                    "head_matches_trunk",
                    PASS,
                    f"only the combination {top.variant.describe()} reaches {_pct(top.acceptance)}",
                )
            )
            for i, c in enumerate(checks):
                if c.status == PASS and _differs(c.name, shipped, top.variant):
                    checks[i] = CheckResult(
                        c.name,
                        FAIL,
                        f"mismatched together with another convention: {_pct(a0)} as shipped, "
                        f"{_pct(top.acceptance)} with {top.variant.describe()}; fix: {_fix(shipped, top.variant)}",
                    )
        else:
            checks.append(
                CheckResult(
                    "head_matches_trunk",
                    FAIL,
                    f"acceptance is low under every variant (best {_pct(top.acceptance)} with "
                    f"{top.variant.describe()}, {len(measurements)} variants tried): the head was "
                    "not trained with this trunk (grafted from another model?); graft the head "
                    "from the trunk's own original checkpoint with `mtpkit convert ORIGINAL "
                    "--mtp-only --into DIR` (if it is the trunk's own head, it is too weak for "
                    "--min-acceptance on these prompts)",
                )
            )
    else:
        top = max(measurements, key=lambda m: m.acceptance)
        checks.append(
            CheckResult(
                "head_matches_trunk",
                PASS,
                f"{_pct(top.acceptance)} under its best variant ({top.variant.describe()})",
            )
        )
    return Diagnosis(checks, a0, best, measurements)


def _fails(c: Comparison, a0: float, min_acceptance: float, zero_centred: bool) -> bool:
    """The rule (see VARIANT_RULES): a usable variant that clearly beats, or keeps, the head.

    The keep rule holds only for families with zero-centred norms, where "without its +1"
    is the documented missing-shift collapse; plain norms are never shifted.
    """
    rule = VARIANT_RULES[c.key]
    a = c.measurement.acceptance
    if a < min_acceptance:
        # Gains among variants that all stay unusable are noise around a head that never worked.
        return False
    keeps = zero_centred and rule.keep_fraction is not None and a >= rule.keep_fraction * a0
    return keeps or c.clears(rule.fail_margin)


def _why(c: Comparison, a0: float) -> str:
    rule = VARIANT_RULES[c.key]
    if rule.keep_fraction is not None and not c.clears(rule.fail_margin):
        return (
            "; a correctly shifted head collapses without one +1, as with a missing shift, "
            "but this one keeps working"
        )
    return ""


def _signed_pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _differs(check: str, shipped: Variant, v: Variant) -> bool:
    return {
        "norm_shift": v.norm_shift != 0,
        "hidden": v.hidden != shipped.hidden,
        "concat_order": v.concat_order != shipped.concat_order,
    }.get(check, False)


def _describe_key(key: str) -> str:
    return {
        "norm_shift=-1": "norms -1",
        "norm_shift=+1": "norms +1",
        "hidden": "the other hidden variant",
        "concat_order": "the other concat order",
    }[key]


def _verdict_words(key: str) -> str:
    return {
        "norm_shift=-1": "norms shifted twice (the head's RMSNorm weights carry an extra +1)",
        "norm_shift=+1": "norm shift missing (the head's zero-centred RMSNorm weights were never shifted by +1)",
        "hidden": "hidden-state variant mismatch",
        "concat_order": "concat order mismatch (the projection's two inputs are swapped)",
    }[key]


# --------------------------------------------------------------------------- probing a source


def _default_measure() -> MeasureFn:
    try:
        from mtpkit.generate import measure_acceptance
    except ImportError as e:  # pragma: no cover - the runtime ships with mtpkit
        raise MtpkitError(f"the MTP runtime is not available ({e}); run with --no-probe") from None
    return measure_acceptance


def measure_per_prompt(
    measure: MeasureFn,
    model_dir: Path,
    prompts: Sequence[str],
    variant: Variant,
    shipped: Variant,
    *,
    max_tokens: int,
) -> Measurement:
    """Acceptance of one variant, prompt by prompt (for the paired comparison)."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "norm_shift": float(variant.norm_shift)}
    # As shipped, the runtime reads its settings from the checkpoint itself.
    kwargs["hidden"] = variant.hidden if variant.hidden != shipped.hidden else None
    kwargs["concat_order"] = (
        variant.concat_order if variant.concat_order != shipped.concat_order else None
    )
    values = []
    for prompt in prompts:
        value = float(measure(str(model_dir), [prompt], **kwargs))
        values.append(value if math.isfinite(value) else 0.0)
    return Measurement(variant, values)


def _cache_root() -> Path:
    root = os.environ.get("MTPKIT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "mtpkit"


@contextmanager
def runnable_copy(ckpt: Checkpoint, *, log: Callable[[str], None]) -> Iterator[Path]:
    """A local MLX directory the runtime can run: the source itself, or a converted copy.

    An MLX directory (mtpkit's sidecar, the inline layout, vllm-mlx sidecars) is probed as it
    is. A raw checkpoint is converted with `mtpkit convert` first, into a temporary directory
    for a local one. A Hub repo is downloaded (MLX layouts) or converted (raw checkpoints)
    into the mtpkit cache, keyed by its commit, and reused on the next run.
    """
    source = ckpt.source
    if source.kind == "local" and ckpt.format == "mlx":
        yield Path(source.root)
        return
    from mtpkit.convert import convert

    if source.kind == "local":
        # A raw checkpoint is run the way users run it: through `mtpkit convert`.
        # In the cache root (on the home disk, like the Hub cache), not in a small /tmp.
        _cache_root().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="check-", dir=_cache_root()) as tmp:
            out = Path(tmp) / "converted"
            log(f"converting {source.describe()} for the probes")
            convert(source.spec, output=out)
            yield out
        return
    key = f"{source.spec.replace('/', '--')}--{source.commit or source.revision or 'main'}"
    out = _cache_root() / "check" / key
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        if ckpt.format == "mlx":
            from huggingface_hub import snapshot_download

            from mtpkit.source import hub_errors

            log(f"downloading {source.describe()} into {out}")
            partial = out.with_name(out.name + ".partial")
            with hub_errors(source.spec, source.revision):
                snapshot_download(
                    source.spec, revision=source.commit or source.revision, local_dir=str(partial)
                )
            shutil.rmtree(partial / ".cache", ignore_errors=True)
            partial.rename(out)
        else:
            log(f"converting {source.describe()} into {out}")
            convert(source.spec, output=out, revision=source.commit or source.revision, force=True)
    yield out


# --------------------------------------------------------------------------- the whole check


def check_checkpoint(
    source: str,
    *,
    revision: str | None = None,
    probe: bool | None = None,
    prompts: Sequence[str] | None = None,
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    measure: MeasureFn | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Check a checkpoint and return the `check --json` object.

    `probe=None` probes directories and skips Hub repos (which would need a download). A
    check that fails makes the verdict `fail`; a warning does not.
    """
    log = log or (lambda message: None)
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
        checks.append(backbone_check(Path(ckpt.source.root), ckpt))
    acceptance: float | None = None
    best: dict[str, Any] | None = None
    if probe and any(c.status == FAIL for c in checks):
        log("probes skipped: a structural check failed")
    elif probe:
        with runnable_copy(ckpt, log=log) as model_dir:
            if not is_local and ckpt.format == "mlx":
                checks.append(backbone_check(model_dir))
            if all(c.status != FAIL for c in checks):
                diagnosis = _probe(
                    ckpt,
                    model_dir,
                    prompts,
                    measure or _default_measure(),
                    reserve=reserve,
                    min_acceptance=min_acceptance,
                    max_tokens=max_tokens,
                    log=log,
                )
                checks.extend(diagnosis.checks)
                acceptance = round(diagnosis.acceptance, 4)
                v = diagnosis.best.variant
                best = {
                    "norm_shift": v.norm_shift,
                    "hidden": v.hidden,
                    "concat_order": v.concat_order,
                    "acceptance": round(diagnosis.best.acceptance, 4),
                }
    verdict = FAIL if any(c.status == FAIL for c in checks) else PASS
    return {
        "source": ckpt.source.spec,
        "revision": ckpt.source.revision,
        "verdict": verdict,
        "checks": [c.as_dict() for c in checks],
        "acceptance": acceptance,
        "best_variant": best,
    }


def _probe(
    ckpt: Checkpoint,
    model_dir: Path,
    prompts: Sequence[str],
    measure: MeasureFn,
    *,
    reserve: Sequence[str],
    min_acceptance: float,
    max_tokens: int,
    log: Callable[[str], None],
) -> Diagnosis:
    shipped = shipped_variant(ckpt)
    started = time.monotonic()

    def measure_variant(v: Variant) -> Measurement:
        log(f"probing {v.describe()} on {len(prompts)} prompts")
        return measure_per_prompt(measure, model_dir, prompts, v, shipped, max_tokens=max_tokens)

    def measure_more(v: Variant) -> Measurement:
        log(f"probing {v.describe()} on {len(reserve)} more prompts (undecided)")
        return measure_per_prompt(measure, model_dir, reserve, v, shipped, max_tokens=max_tokens)

    diagnosis = diagnose(
        measure_variant,
        shipped,
        min_acceptance=min_acceptance,
        zero_centred=ckpt.family.zero_centred_norms,
        measure_more=measure_more if reserve else None,
    )
    log(f"probes took {time.monotonic() - started:.0f} s")
    return diagnosis


# --------------------------------------------------------------------------- reports


def junit_xml(result: dict[str, Any]) -> str:
    """A JUnit XML report: one test suite per source, one test case per check.

    A failed check is a `<failure>`; a warning passes with the warning in `<system-out>`.
    """
    checks = result["checks"]
    failures = sum(1 for c in checks if c["status"] == FAIL)
    where = result["source"] + (f"@{result['revision']}" if result.get("revision") else "")
    suites = ET.Element(
        "testsuites",
        name="mtpkit check",
        tests=str(len(checks)),
        failures=str(failures),
        errors="0",
    )
    suite = ET.SubElement(
        suites,
        "testsuite",
        name=where,
        tests=str(len(checks)),
        failures=str(failures),
        errors="0",
        skipped="0",
    )
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="verdict", value=result["verdict"])
    if result.get("acceptance") is not None:
        ET.SubElement(props, "property", name="acceptance", value=str(result["acceptance"]))
    if result.get("best_variant"):
        for k, v in result["best_variant"].items():
            ET.SubElement(props, "property", name=f"best_variant.{k}", value=str(v))
    classname = "mtpkit.check." + re.sub(r"[^\w.-]+", "_", where)
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=classname, name=c["name"])
        if c["status"] == FAIL:
            failure = ET.SubElement(case, "failure", message=c["detail"], type=c["name"])
            failure.text = c["detail"]
        elif c["status"] == WARN:
            out = ET.SubElement(case, "system-out")
            out.text = f"warning: {c['detail']}"
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def junit_error_xml(source: str, revision: str | None, message: str) -> str:
    """A JUnit report for a check that could not run (exit 1), so CI still shows why."""
    where = source + (f"@{revision}" if revision else "")
    suites = ET.Element("testsuites", name="mtpkit check", tests="1", failures="0", errors="1")
    suite = ET.SubElement(
        suites, "testsuite", name=where, tests="1", failures="0", errors="1", skipped="0"
    )
    case = ET.SubElement(
        suite, "testcase", classname="mtpkit.check." + re.sub(r"[^\w.-]+", "_", where), name="check"
    )
    error = ET.SubElement(case, "error", message=message, type="MtpkitError")
    error.text = message
    ET.indent(suites)
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
    )


def write_junit(result: dict[str, Any] | str, path: str | Path) -> None:
    """Write a report (a result, or XML text from `junit_error_xml`) to `path`."""
    path = Path(path)
    text = result if isinstance(result, str) else junit_xml(result)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise MtpkitError(f"cannot write the JUnit report to {path}: {e}") from None


STATUS_STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red"}


def print_report(result: dict[str, Any]) -> None:
    """The rich table people read."""
    from rich.table import Table

    from mtpkit.output import stdout

    where = result["source"] + (f"@{result['revision']}" if result.get("revision") else "")
    table = Table(title=f"mtpkit check {where}", title_justify="left")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail")
    for c in result["checks"]:
        style = STATUS_STYLE[c["status"]]
        table.add_row(c["name"], f"[{style}]{c['status']}[/{style}]", c["detail"])
    stdout.print(table)
    line = f"verdict: {result['verdict']}"
    if result.get("acceptance") is not None:
        line += f" (acceptance {_pct(result['acceptance'])} as shipped"
        best = result.get("best_variant")
        if best and (best["norm_shift"] or best["acceptance"] != result["acceptance"]):
            line += f"; best {_pct(best['acceptance'])} with norms {best['norm_shift']:+d}, {best['hidden']}, {best['concat_order']}"
        line += ")"
    elif not any(c["name"] == "acceptance" for c in result["checks"]):
        line += " (no probes run)"
    style = STATUS_STYLE[result["verdict"]]
    stdout.print(f"[{style}]{line}[/{style}]")


def stderr_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
