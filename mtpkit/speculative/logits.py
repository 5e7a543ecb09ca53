"""Logits processors and log-probabilities, as mlx-lm's `generate_step` applies and reports
them, for speculative rounds too.

mlx-lm's processors (`make_logits_processors`: logit bias, repetition, presence and frequency
penalties) change the target's logits at each step from the tokens before it. A verify pass
scores K+1 positions at once; the processors run on each row with the tokens up to that row
(the confirmed history, then the drafts before it), so greedy matching and rejection
sampling judge every draft against exactly the distribution mlx-lm would sample from there.

XTC is a sampler, not a processor: at temperature 0 mlx-lm's sampler is the argmax and XTC
does nothing; at a temperature its random cut per token cannot judge a draft, so such a
request decodes without drafting, with mlx-lm's own XTC sampler (`LogitsSettings.plain_only`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

Processor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class LogitsSettings:
    """A request's processors and XTC (mlx_lm.server's fields, its defaults)."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1

    @property
    def processes(self) -> bool:
        """Whether any processor changes the logits (known without building one)."""
        return bool(
            self.logit_bias or self.repetition_penalty or self.presence_penalty
            or self.frequency_penalty
        )  # fmt: skip

    def processors(self) -> list[Processor]:
        from mlx_lm.sample_utils import make_logits_processors

        return make_logits_processors(
            self.logit_bias or None, self.repetition_penalty or None,
            self.repetition_context_size, self.presence_penalty or None,
            self.presence_context_size, self.frequency_penalty or None,
            self.frequency_context_size,
        )  # fmt: skip

    def plain_only(self, temp: float) -> bool:
        """Whether the request must decode without drafting (XTC at a temperature)."""
        return self.xtc_probability > 0 and temp > 0

    def xtc_sampler(self, sampling: Any, tokenizer: Any) -> Callable[[mx.array], mx.array]:
        """mlx_lm.server's sampler with XTC (`_make_sampler`)."""
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(
            sampling.temp, top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
            xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold,
            xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
        )  # fmt: skip


NO_PROCESSING = LogitsSettings()


def process_rows(
    processors: list[Processor], history: list[int], logits: mx.array, drafts: mx.array
) -> mx.array:
    """`logits` [K+1, V] of a verify pass after `history` (prompt and confirmed tokens, the
    pass's first input last), each row processed with the tokens before it: row i sees the
    history and the first i drafts (lazily; nothing is read)."""
    if not processors:
        return logits
    past = mx.array(history, dtype=mx.int32)
    rows = []
    for i in range(logits.shape[0]):
        tokens = mx.concatenate([past, drafts[:i].astype(mx.int32)]) if i else past
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(tokens, row)
        rows.append(row)
    return mx.concatenate(rows)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target (after the processors), and the
    `top` most likely tokens there as (id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """The `TokenLogprob` of `tokens[i]` at row i of `logits` [>= len(tokens), V]: one host
    read for the round."""
    rows = logits[: len(tokens)]  # in the logits' dtype, as mlx-lm's generate_step
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    if top <= 0:
        return [TokenLogprob(v) for v in chosen.tolist()]
    order = mx.argsort(-logprobs, axis=-1)[:, :top]
    values = mx.take_along_axis(logprobs, order, axis=-1)
    mx.eval(chosen, order, values)
    return [
        TokenLogprob(lp, tuple(zip(ids, vals, strict=True)))
        for lp, ids, vals in zip(chosen.tolist(), order.tolist(), values.tolist(), strict=True)
    ]
