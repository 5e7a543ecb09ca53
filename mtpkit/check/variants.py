"""The variants `mtpkit check` runs a head under, their margins, and how they compare.

A variant changes one or more of the runtime conventions (norms -1/+1, the other hidden
state, the other concat order). `VARIANT_RULES` holds the margins each must clear (why each
is safe: README.md); `compare` pairs a variant's per-prompt acceptances with the shipped
head's. The rule table that turns comparisons into checks is `probes.py`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtpkit.core.choices import CONCAT_ORDERS, DEFAULT_HIDDEN, HIDDEN_VARIANTS

PASS, WARN, FAIL = "pass", "warn", "fail"
# A probe check that did not run because a structural check failed first: reported (JSON,
# JUnit `<skipped>`) so CI dashboards keep every case; it does not fail the verdict.
SKIP = "skip"


DEFAULT_MIN_ACCEPTANCE = 0.2
DEFAULT_MAX_TOKENS = 48
# Standard errors a variant's mean per-prompt gain must clear (one-sided p < 0.002 under a
# normal approximation), so noise on a healthy head never reads as a convention error.
SIGNIFICANCE_Z = 3.0
# What some convention change costs any head that uses its inputs: swapped projection inputs
# or norms without their +1 collapse it (5.4% and 0.0% vs 66.0% on the example). A head that
# no change moves by this much is not reading the trunk's hidden state.
RESPONSE_MARGIN = 0.05


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


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
# Figures: the trained example (`mtpkit check mtpkit/examples/tiny-qwen3_5`), 66.0% as shipped.
VARIANT_RULES = {
    # Taking +1 off a correctly shifted head's norms is exactly the missing-shift failure: the
    # head collapses (0.0% on the example). So a head that keeps even half its acceptance
    # without one +1 carries an extra +1. This does not depend on what the double shift costs,
    # which can be only a few points (RMSNorm is nearly scale-free; 14.8 points on the example)
    # and then is hard to tell from noise on a few prompts.
    "norm_shift=-1": VariantRule("norm_shift", 0.01, 0.01, keep_fraction=0.5),
    # On a healthy head, +1 is a double shift: some points down (51.2% on the example), or up by
    # chance. A missing shift collapses the head, so a real one gains tens of points.
    "norm_shift=+1": VariantRule("norm_shift", 0.05, 0.05),
    # Swapped projection inputs collapse a head (5.4% on the example); a real mismatch gains
    # tens of points.
    "concat_order": VariantRule("concat_order", 0.05, 0.05),
    # Both hidden-state variants are in use and a head tolerates the other one at a cost of a
    # few points (80.3% vs 75.2% on Qwen3.6-27B; 63.4% vs 66.0% on the example), so a gain
    # under 5 points only warns.
    "hidden": VariantRule("hidden", 0.05, 0.02),
}
# How each variant is named in a check's detail, and what its failure means.
VARIANT_NAMES = {
    "norm_shift=-1": "norms -1",
    "norm_shift=+1": "norms +1",
    "hidden": "the other hidden variant",
    "concat_order": "the other concat order",
}
VARIANT_VERDICTS = {
    "norm_shift=-1": "norms shifted twice (the head's RMSNorm weights carry an extra +1)",
    "norm_shift=+1": "norm shift missing (the head's zero-centred RMSNorm weights were never shifted by +1)",
    "hidden": "hidden-state variant mismatch",
    "concat_order": "concat order mismatch (the projection's two inputs are swapped)",
}


@dataclass(frozen=True)
class Variant:
    """Runtime settings a probe runs the head with."""

    norm_shift: int
    hidden: str
    concat_order: str

    def describe(self) -> str:
        shift = f"norms {self.norm_shift:+d}" if self.norm_shift else "norms as shipped"
        return f"{shift}, {self.hidden}, {self.concat_order}"

    def differs_in(self, check: str, shipped: Variant) -> bool:
        """Whether this variant changes the convention `check` tests, relative to `shipped`."""
        return {
            "norm_shift": self.norm_shift != 0,
            "hidden": self.hidden != shipped.hidden,
            "concat_order": self.concat_order != shipped.concat_order,
        }.get(check, False)


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


# measure(model_dir, prompts, *, max_tokens, hidden, concat_order, norm_shift) -> acceptance,
# or None when nothing was drafted (the text ended at once)
MeasureFn = Callable[..., float | None]


def shipped_variant(manifest: Any, family_concat_order: str) -> Variant:
    """What the runtime runs the head with: the manifest's record, else the family's default."""
    m = manifest if isinstance(manifest, dict) else {}
    hidden = m.get("hidden") if m.get("hidden") in HIDDEN_VARIANTS else DEFAULT_HIDDEN
    order = m.get("concat_order")
    return Variant(0, hidden, order if order in CONCAT_ORDERS else family_concat_order)


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


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def fix_for(shipped: Variant, best: Variant) -> str:
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
