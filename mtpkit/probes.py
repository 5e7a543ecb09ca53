"""The numeric probes of `mtpkit check`: variants, their measurement, and the diagnosis.

The probes generate greedily with the head on short prompts and measure acceptance as
shipped, then under variants (norms shifted by -1 and +1, the other hidden-state variant,
the other concat order), so a double or missing norm shift or a mismatched convention is
named with its fix.

The verdict rule (see `VARIANT_RULES`, and README.md for why each margin is safe): a variant
fails the head as shipped when it makes the head usable (reaches --min-acceptance) and gains at
least its margin, at `SIGNIFICANCE_Z` standard errors of the paired per-prompt differences; for
norms -1 on zero-centred families, keeping half the shipped acceptance is enough, because a
correctly shifted head collapses without its +1. Greedy verification is lossless, so every
variant is scored on the same backbone text and the comparison is paired, prompt by prompt.
Undecided gains are measured again on reserve prompts. When no single variant rescues the
head, every combination is tried before the head is blamed on the trunk. `CONVENTION_RULES`
turns the comparisons into checks: its rows are tried in order, the first that holds decides.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

PASS, WARN, FAIL = "pass", "warn", "fail"

HIDDEN_VARIANTS = ("post_norm", "pre_norm")
CONCAT_ORDERS = ("embedding_first", "hidden_first")
# What the runtime feeds the head when a checkpoint records nothing (vLLM/transformers default).
DEFAULT_HIDDEN = "post_norm"

DEFAULT_MIN_ACCEPTANCE = 0.2
DEFAULT_MAX_TOKENS = 48
# Standard errors a variant's mean per-prompt gain must clear (one-sided p < 0.002 under a
# normal approximation), so noise on a healthy head never reads as a convention error.
SIGNIFICANCE_Z = 3.0


@dataclass
class CheckResult:
    name: str
    status: str
    detail: str

    def as_dict(self) -> dict[str, str]:
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


# measure(model_dir, prompts, *, max_tokens, hidden, concat_order, norm_shift) -> acceptance
MeasureFn = Callable[..., float]


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


# --------------------------------------------------------------------------- the rule table


@dataclass(frozen=True)
class Evidence:
    """What every rule may look at: the shipped head's measurement and the settings."""

    shipped: Variant
    base: Measurement
    min_acceptance: float
    zero_centred: bool

    @property
    def a0(self) -> float:
        return self.base.acceptance


def fails(c: Comparison, e: Evidence) -> bool:
    """A usable variant that clearly beats, or keeps, the head (see VARIANT_RULES).

    Gains among variants that all stay unusable are noise around a head that never worked.
    The keep rule holds only for families with zero-centred norms, where "without its +1"
    is the documented missing-shift collapse; plain norms are never shifted.
    """
    rule = VARIANT_RULES[c.key]
    a = c.measurement.acceptance
    if a < e.min_acceptance:
        return False
    keeps = e.zero_centred and rule.keep_fraction is not None and a >= rule.keep_fraction * e.a0
    return keeps or c.clears(rule.fail_margin)


def warns(c: Comparison, e: Evidence) -> bool:
    """A significant gain under the failing margin."""
    return c.clears(VARIANT_RULES[c.key].warn_margin)


def undecided(c: Comparison, e: Evidence) -> bool:
    """A gain that reaches the warning margin but not significance, on a usable variant."""
    margin = VARIANT_RULES[c.key].warn_margin
    return (
        c.gain >= margin and not c.clears(margin) and c.measurement.acceptance >= e.min_acceptance
    )


def _fail_detail(c: Comparison, cs: list[Comparison], e: Evidence) -> str:
    rule = VARIANT_RULES[c.key]
    why = ""
    if rule.keep_fraction is not None and not c.clears(rule.fail_margin):
        why = (
            "; a correctly shifted head collapses without one +1, as with a missing shift, "
            "but this one keeps working"
        )
    a = c.measurement.acceptance
    return (
        f"{VARIANT_VERDICTS[c.key]}: {pct(e.a0)} as shipped, {pct(a)} with "
        f"{VARIANT_NAMES[c.key]} ({100 * c.gain:+.1f}% ± {pct(c.stderr)}){why}; "
        f"fix: {fix_for(e.shipped, c.measurement.variant)}"
    )


def _warn_detail(c: Comparison, cs: list[Comparison], e: Evidence) -> str:
    return (
        f"{VARIANT_NAMES[c.key]} gains {pct(c.gain)} ± {pct(c.stderr)} "
        f"({pct(c.measurement.acceptance)} vs {pct(e.a0)}), under the "
        f"{pct(VARIANT_RULES[c.key].fail_margin)} that fails; consider: "
        f"{fix_for(e.shipped, c.measurement.variant)}"
    )


def _inconclusive_detail(c: Comparison, cs: list[Comparison], e: Evidence) -> str:
    return (
        f"inconclusive: {VARIANT_NAMES[c.key]} gains {pct(c.gain)} ± {pct(c.stderr)}; "
        "probe more prompts with --prompts FILE"
    )


def _pass_detail(c: Comparison, cs: list[Comparison], e: Evidence) -> str:
    summary = ", ".join(f"{VARIANT_NAMES[c.key]} {pct(c.measurement.acceptance)}" for c in cs)
    return f"as shipped {pct(e.a0)}; {summary}"


def _largest_gain(cs: list[Comparison]) -> Comparison:
    return max(cs, key=lambda c: c.gain)


def _first(cs: list[Comparison]) -> Comparison:
    return cs[0]


@dataclass(frozen=True)
class Rule:
    """One row: when `holds` for some variant of a check, the check gets `status`.

    `pick` chooses the variant named among those the row holds for; `detail` writes the text.
    A failing row's variant is a winner: the verdict settles on it.
    """

    status: str
    holds: Callable[[Comparison, Evidence], bool]
    pick: Callable[[list[Comparison]], Comparison]
    detail: Callable[[Comparison, list[Comparison], Evidence], str]


CONVENTION_RULES = (
    Rule(FAIL, fails, _largest_gain, _fail_detail),
    Rule(WARN, warns, _largest_gain, _warn_detail),
    Rule(WARN, undecided, _first, _inconclusive_detail),
    Rule(PASS, lambda c, e: True, _first, _pass_detail),
)
CONVENTION_CHECKS = ("norm_shift", "hidden", "concat_order")


def judge_convention(
    check: str, comparisons: dict[str, Comparison], e: Evidence
) -> tuple[CheckResult, Comparison | None]:
    """The first row of CONVENTION_RULES that holds for one of the check's variants."""
    cs = [comparisons[k] for k, r in VARIANT_RULES.items() if r.check == check]
    for rule in CONVENTION_RULES:
        held = [c for c in cs if rule.holds(c, e)]
        if held:
            c = rule.pick(held)
            winner = c if rule.status == FAIL else None
            return CheckResult(check, rule.status, rule.detail(c, cs, e)), winner
    raise AssertionError("the last rule always holds")


# --------------------------------------------------------------------------- the diagnosis


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
    evidence = Evidence(shipped, base, min_acceptance, zero_centred)
    if measure_more is not None:
        evidence = settle_undecided(evidence, comparisons, measurements, measure_more)
    checks = [acceptance_check(evidence)]
    winners: list[Comparison] = []
    for check in CONVENTION_CHECKS:
        result, winner = judge_convention(check, comparisons, evidence)
        checks.append(result)
        winners += [winner] if winner is not None else []
    best = best_of_winners(winners, evidence, measure_variant, measurements)
    best = judge_trunk(evidence, checks, measurements, best, measure_variant)
    return Diagnosis(checks, evidence.a0, best, measurements)


def settle_undecided(
    e: Evidence,
    comparisons: dict[str, Comparison],
    measurements: list[Measurement],
    measure_more: Callable[[Variant], Measurement],
) -> Evidence:
    """Measure undecided variants (and the shipped head) again on the reserve prompts.

    Updates `comparisons` and `measurements` in place; returns the evidence with the shipped
    head measured over all prompts.
    """
    pending = [c for c in comparisons.values() if undecided(c, e)]
    if not pending:
        return e
    more = measure_more(e.shipped)
    base = Measurement(e.shipped, e.base.per_prompt + more.per_prompt)
    measurements[0] = base
    for c in pending:
        extra = measure_more(c.measurement.variant)
        joined = Measurement(c.measurement.variant, c.measurement.per_prompt + extra.per_prompt)
        comparisons[c.key] = compare(base, joined, c.key)
        measurements[measurements.index(c.measurement)] = joined
    return replace(e, base=base)


def acceptance_check(e: Evidence) -> CheckResult:
    n, minimum = len(e.base.per_prompt), pct(e.min_acceptance)
    if e.a0 >= e.min_acceptance:
        return CheckResult(
            "acceptance", PASS, f"{pct(e.a0)} as shipped over {n} prompts (minimum {minimum})"
        )
    return CheckResult(
        "acceptance", FAIL, f"{pct(e.a0)} as shipped over {n} prompts, below the minimum {minimum}"
    )


def best_of_winners(
    winners: list[Comparison],
    e: Evidence,
    measure_variant: Callable[[Variant], Measurement],
    measurements: list[Measurement],
) -> Measurement:
    """The variant the verdict settles on: the biggest winner (or all winners combined)."""
    best = max((c.measurement for c in winners), key=lambda m: m.acceptance, default=e.base)
    if len(winners) < 2:
        return best
    variants = {c.key: c.measurement.variant for c in winners}
    shift = next((v.norm_shift for k, v in variants.items() if k.startswith("norm")), 0)
    combined = Variant(
        shift,
        variants["hidden"].hidden if "hidden" in variants else e.shipped.hidden,
        variants["concat_order"].concat_order
        if "concat_order" in variants
        else e.shipped.concat_order,
    )
    joint = measure_variant(combined)
    measurements.append(joint)
    return joint if joint.acceptance > best.acceptance else best


def judge_trunk(
    e: Evidence,
    checks: list[CheckResult],
    measurements: list[Measurement],
    best: Measurement,
    measure_variant: Callable[[Variant], Measurement],
) -> Measurement:
    """Append `head_matches_trunk`; returns the best variant.

    When no variant so far reaches the minimum, every combination is tried first. A
    combination that rescues the head fails each passing check whose convention it changes.
    """
    if max(m.acceptance for m in measurements) >= e.min_acceptance:
        top = max(measurements, key=lambda m: m.acceptance)
        detail = f"{pct(top.acceptance)} under its best variant ({top.variant.describe()})"
        checks.append(CheckResult("head_matches_trunk", PASS, detail))
        return best
    tried = {m.variant for m in measurements}
    measurements += [measure_variant(v) for v in all_variants(e.shipped) if v not in tried]
    top = max(measurements, key=lambda m: m.acceptance)
    rescued = top.acceptance >= e.min_acceptance and compare(e.base, top).clears(
        VARIANT_RULES["norm_shift=+1"].fail_margin
    )
    if not rescued:
        checks.append(
            CheckResult(
                "head_matches_trunk",
                FAIL,
                f"acceptance is low under every variant (best {pct(top.acceptance)} with "
                f"{top.variant.describe()}, {len(measurements)} variants tried): the head was "
                "not trained with this trunk (grafted from another model?); graft the head "
                "from the trunk's own original checkpoint with `mtpkit convert ORIGINAL "
                "--mtp-only --into DIR` (if it is the trunk's own head, it is too weak for "
                "--min-acceptance on these prompts)",
            )
        )
        return best
    detail = f"only the combination {top.variant.describe()} reaches {pct(top.acceptance)}"
    checks.append(CheckResult("head_matches_trunk", PASS, detail))
    for i, c in enumerate(checks):
        if c.status == PASS and top.variant.differs_in(c.name, e.shipped):
            checks[i] = CheckResult(
                c.name,
                FAIL,
                f"mismatched together with another convention: {pct(e.a0)} as shipped, "
                f"{pct(top.acceptance)} with {top.variant.describe()}; fix: "
                f"{fix_for(e.shipped, top.variant)}",
            )
    return top
