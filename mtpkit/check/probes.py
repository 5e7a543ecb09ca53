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

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from mtpkit.check.variants import (
    CONCAT_ORDERS,
    DEFAULT_HIDDEN,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_ACCEPTANCE,
    FAIL,
    HIDDEN_VARIANTS,
    PASS,
    RESPONSE_MARGIN,
    SIGNIFICANCE_Z,
    VARIANT_NAMES,
    VARIANT_RULES,
    VARIANT_VERDICTS,
    WARN,
    CheckResult,
    Comparison,
    MeasureFn,
    Measurement,
    Variant,
    VariantRule,
    all_variants,
    compare,
    fix_for,
    pct,
    shipped_variant,
    single_variants,
)

__all__ = [
    "CONCAT_ORDERS",
    "DEFAULT_HIDDEN",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MIN_ACCEPTANCE",
    "FAIL",
    "HIDDEN_VARIANTS",
    "PASS",
    "SIGNIFICANCE_Z",
    "VARIANT_NAMES",
    "VARIANT_RULES",
    "VARIANT_VERDICTS",
    "WARN",
    "CheckResult",
    "Comparison",
    "MeasureFn",
    "Measurement",
    "Variant",
    "VariantRule",
    "all_variants",
    "compare",
    "fix_for",
    "pct",
    "shipped_variant",
    "single_variants",
    "Diagnosis",
    "Evidence",
    "Rule",
    "diagnose",
]

# --------------------------------------------------------------------------- the rule table


@dataclass(frozen=True)
class Evidence:
    """What every rule may look at: the shipped head's measurement and the settings."""

    shipped: Variant
    base: Measurement
    min_acceptance: float
    zero_centred: bool
    # The single variants that cost the shipped head at least RESPONSE_MARGIN: proof that
    # the head responds to its conventions at all (a head that uses its inputs collapses
    # when they are swapped or its norms lose their +1).
    collapsed: frozenset[str] = frozenset()

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
    # Keeping up without one +1 means something only if the head collapses under another
    # change: a head that no change moves (every variant at the same floor) proves nothing.
    keeps = (
        e.zero_centred
        and rule.keep_fraction is not None
        and a >= rule.keep_fraction * e.a0
        and bool(e.collapsed - {c.key})
    )
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
    summary = ", ".join(f"{VARIANT_NAMES[c.key]} {_measured(c, e)}" for c in cs)
    return f"as shipped {pct(e.a0)}; {summary}"


def _measured(c: Comparison, e: Evidence) -> str:
    """A variant's acceptance, with its prompt count where it stopped early (collapsed)."""
    n = len(c.measurement.per_prompt)
    part = f" (first {n} prompts)" if n < len(e.base.per_prompt) else ""
    return pct(c.measurement.acceptance) + part


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
    collapsed = frozenset(k for k, c in comparisons.items() if c.gain <= -RESPONSE_MARGIN)
    evidence = replace(evidence, collapsed=collapsed)
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


def unresponsive_detail(e: Evidence) -> str:
    return (
        f"{pct(e.a0)} as shipped, and no convention change moves it by "
        f"{pct(RESPONSE_MARGIN)} (swapped inputs, norms -1/+1, the other hidden state all "
        "score alike): the head does not use this trunk's hidden state, so its acceptance is "
        "what the prompts give any head; graft the head from the trunk's own original "
        "checkpoint with `mtpkit convert ORIGINAL --mtp-only --into DIR`"
    )


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
        if not e.collapsed and best.variant == e.shipped:
            checks.append(CheckResult("head_matches_trunk", FAIL, unresponsive_detail(e)))
            return best
        # The variant named is the one `best_variant` reports: the table and text agree.
        detail = f"{pct(best.acceptance)} under the settled variant ({best.variant.describe()})"
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
