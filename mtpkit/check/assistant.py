"""`mtpkit check ASSISTANT --target TARGET`: the verdict on a Gemma 4 assistant with its target.

Three checks, as `check` makes them for a head: the assistant's structure (what `inspect`
finds), the pairing (the facts of both configs and headers: hidden size, vocabulary, the
layer types and head sizes it reads), and the acceptance it reaches drafting for the target
(greedy, depth 1, over the probe prompts), which must reach `min_acceptance`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mtpkit.check.variants import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_MIN_ACCEPTANCE,
    FAIL,
    PASS,
    SKIP,
    CheckResult,
)
from mtpkit.checkpoint.inspect import read_checkpoint
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import BUILTIN_PROMPTS
from mtpkit.families.gemma4_assistant import pairing_problems


def check_assistant(
    source: str,
    *,
    target: str | None,
    revision: str | None = None,
    probe: bool | None = None,
    prompts: Sequence[str] | None = None,
    min_acceptance: float = DEFAULT_MIN_ACCEPTANCE,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The `check --json` object for an assistant and its target (see the module's text)."""
    log = log or (lambda message: None)
    if target is None:
        raise MtpkitError(
            f"{source} is a Gemma 4 assistant: pass --target TARGET, the model it drafts for"
        )
    ckpt = read_checkpoint(source, revision=revision)
    target_ckpt = read_checkpoint(target)
    problems = [p["message"] for p in ckpt.problems]
    checks = [
        CheckResult("structure", FAIL, problems[0])
        if problems
        else CheckResult("structure", PASS, f"{len(ckpt.tensors)} tensors, as a published one")
    ]
    facts, wants = ckpt.family.pairing() or {}, target_ckpt.family.pairing()
    if not wants or wants.get("role") != "target":
        mismatch = [f"{target} is a {target_ckpt.family.name} model, not a Gemma 4 target"]
    else:
        mismatch = pairing_problems(facts, wants)
    checks.append(
        CheckResult("pairing", FAIL, mismatch[0])
        if mismatch
        else CheckResult(
            "pairing",
            PASS,
            f"reads {', '.join(f'{k} layer {v}' for k, v in wants['kv_source_layers'].items())}"
            f" of a hidden-size-{wants['hidden_size']} target",
        )
    )
    acceptance = None
    probe = ckpt.source.kind == "local" if probe is None else probe
    if not probe or any(c.status == FAIL for c in checks):
        why = "a check above failed" if probe else "--no-probe"
        checks.append(CheckResult("acceptance", SKIP, f"not measured: {why}"))
    else:
        log(f"measuring acceptance: {source} drafting for {target}")
        acceptance = measure(source, target, list(prompts or BUILTIN_PROMPTS), max_tokens)
        status = PASS if acceptance >= min_acceptance else FAIL
        detail = f"{100 * acceptance:.1f}% greedy at depth 1 (minimum {100 * min_acceptance:.0f}%)"
        checks.append(CheckResult("acceptance", status, detail))
    verdict = FAIL if any(c.status == FAIL for c in checks) else PASS
    return {
        "source": source,
        "revision": revision,
        "target": target,
        "family": ckpt.family.name,
        "pairing": facts,
        "checks": [c.to_json() for c in checks],
        "verdict": verdict,
        "acceptance": acceptance,
    }


def measure(source: str, target: str, prompts: list[str], max_tokens: int) -> float:
    """Greedy depth-1 acceptance of the assistant drafting for the target over `prompts`."""
    from mtpkit.core.prompts import encode_prompt
    from mtpkit.runtime.model import load_model
    from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
    from mtpkit.speculative.generate import check_prompt
    from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory

    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=source))
    drafted = accepted = 0
    for text in prompts:
        tokens = encode_prompt(m.tokenizer, text)
        check_prompt(m, tokens)
        decoder = MtpDecoder(
            m, tokens, depth=1, sampling=SamplingSettings(), adaptive=False, proposer=factory()
        )
        for _ in decoder.tokens(max_tokens):
            pass
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    return accepted / drafted if drafted else 0.0
