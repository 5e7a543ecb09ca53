"""`mtpkit generate -p A -p B ...`: several prompts decoded together in one batch.

The prompts are requests of one `BatchSession`: with the MTP head (or any drafter that batches:
prompt lookup, a draft model, DFlash, EAGLE-3) each row drafts, accepts and rolls back on its own
(`speculative/batch/decode.py`); without a drafter (`--no-mtp`, or
`--mtp auto` on a model with no head) the rows take plain batched steps, as mlx-lm's
`batch_generate` does. Each request's text and counts are its own (`GenerationResult`, as
one stream reports them); the batch adds the aggregate rates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.core.choices import TOP_P_OFF, require_depth
from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import GenerateError, MtpModel
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.batch.session import BatchEntry, BatchSession
from mtpkit.speculative.generate import (
    GenerationResult,
    add_eos_tokens,
    generation_result,
    load_target,
    prompt_tokens,
    use_head,
)
from mtpkit.speculative.proposers.choose import DrafterChoice
from mtpkit.speculative.session import HEAD, STOP, Engine, Request, check_prompt, check_seed


@dataclass
class BatchGenerationResult:
    """Every request's result, in the prompts' order, and the batch's aggregate rates
    (prompt tokens over the prefills' time; tokens after each request's first over the
    decoding time, as mlx-lm's `batch_generate` counts them)."""

    results: list[GenerationResult]
    prompt_tps: float
    decode_tps: float | None
    peak_memory_gb: float
    mtp: bool
    drafter: str = "mtp"  # what drafted ("none": plain batched steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "batch": len(self.results),
            "mtp": self.mtp,
            "drafter": self.drafter,
            "prompt_tps": self.prompt_tps,
            "decode_tps": self.decode_tps,
            "peak_memory_gb": self.peak_memory_gb,
            "requests": [r.to_json() for r in self.results],
        }


def generate_batch(
    model: str | Path | MtpModel,
    prompts: Sequence[str | list[int]],
    *,
    max_tokens: int = 256,
    mtp: bool | str = True,
    depth: int | None = None,
    temp: float = 0.0,
    top_p: float = TOP_P_OFF,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    seed: int | None = None,
    hidden: str | None = None,
    adaptive: bool = True,
    extra_eos_tokens: Sequence[str] = (),
    warn: Callable[[str], None] | None = None,
    adapter_path: str | None = None,
    drafter: DrafterChoice = HEAD,
    **template: Any,
) -> BatchGenerationResult:
    """Decode `prompts` together. `mtp` True drafts with the head (required), "auto" drafts
    when there is one, False decodes plainly (batched steps, no drafts). Request i samples with
    seed `seed + i` (its own key, so its text is the same in any batch); `depth`: the drafts
    each row verifies a round (None: 1); `adaptive`
    decides per batch width whether a round drafts; `drafter`: what drafts (the head, or
    prompt lookup). `template`: `generate`'s chat-template
    arguments (chat_template, system_prompt, prefill_response, template_args,
    default_template)."""
    check_seed(seed)
    check_seed(None if seed is None else seed + max(len(prompts) - 1, 0))  # row i: seed + i
    sampling = SamplingSettings.checked(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep
    )
    if depth is not None:
        require_depth(depth)
    if not prompts:
        raise GenerateError("no prompt to decode")
    m = load_target(model, mtp=mtp, hidden=hidden, pipeline=False, drafter=drafter,
                    adapter_path=adapter_path)  # fmt: skip
    drafts = use_head(m, mtp, warn) if drafter.uses_head else bool(mtp)
    add_eos_tokens(m, extra_eos_tokens)
    encoded = [prompt_tokens(m, p, **template) for p in prompts]
    for i, tokens in enumerate(encoded, 1):
        try:
            check_prompt(m, tokens)
        except MtpkitError as e:  # which of the prompts it is
            raise type(e)(f"prompt {i} of {len(encoded)}: {e}") from None
    sampling = sampling.fitted(m.vocab_size)
    mx.reset_peak_memory()
    engine = Engine(m, drafter=drafter, mtp=drafts, prompt_cache_size=0)
    return _batch(engine, encoded, max_tokens, sampling, seed, depth, adaptive)


def _batch(
    engine: Engine, prompts: list[list[int]], max_tokens: int, sampling: SamplingSettings,
    seed: int | None, depth: int | None, adaptive: bool,
) -> BatchGenerationResult:  # fmt: skip
    """Every prompt joins one `BatchSession` before the first round; rounds (or plain
    batched steps, without a drafter) run until the last request ends."""
    m, drafts = engine.m, engine.drafts
    session = BatchSession(engine, adaptive=adaptive)
    start = time.perf_counter()
    entries = [
        session.add(
            Request(
                p,
                max_tokens,
                sampling,
                seed=None if seed is None else seed + i,
                depth=depth,
                adaptive=adaptive,
            ),
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]
    decode_start = time.perf_counter()
    ended = {id(e): decode_start for e in entries if e.done}
    while session.entries:
        for entry in session.step():
            if entry.done:
                ended[id(entry)] = time.perf_counter()
    end = time.perf_counter()
    results = [
        _entry_result(m, e, ended[id(e)] - decode_start, max_tokens, drafts) for e in entries
    ]
    after_first = sum(max(len(r.tokens) - 1, 0) for r in results)
    return BatchGenerationResult(
        results,
        prompt_tps=sum(map(len, prompts)) / max(decode_start - start, 1e-9),
        decode_tps=after_first / (end - decode_start) if after_first else None,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        mtp=drafts,
        drafter=engine.drafter_name,
    )


def _entry_result(
    m: MtpModel, entry: BatchEntry, decode_time: float, max_tokens: int, drafts: bool
) -> GenerationResult:
    """One request's result as one stream reports it (`generation_result`): its own text, tokens and
    drafting counts, its decode rate over the time it decoded in the batch; its prompt rate
    is the batch's (`BatchGenerationResult.prompt_tps`)."""
    stats = entry.stats
    stats.decode_tokens, stats.decode_time = max(len(stats.generated) - 1, 0), decode_time
    finish = STOP if entry.finish_reason == STOP else "length"
    return generation_result(m, entry.text, stats, drafts, max_tokens, finish)


__all__ = ["BatchGenerationResult", "generate_batch"]
