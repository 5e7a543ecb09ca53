"""Prompt lookup (vLLM's n-gram proposer): the tokens that followed the most recent earlier
occurrence of the text's last n tokens propose the next ones, for n from `max_n` down to
`min_n`. No weights and no device work: code edits, retrieval answers and summaries repeat
their context. A step with no match is a plain step, so the lookup costs only the search.
It proposes deterministically, so when sampling each draft's distribution is one-hot and
exact rejection sampling keeps a draft with the target's own probability of it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtpkit.core.errors import MtpkitError
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import Proposal, ProposerBase, one_hot

DEFAULT_MIN_N, DEFAULT_MAX_N = 2, 4
# A round's cost in target steps, for adaptive drafting: a verify pass and nothing drafted.
# An estimate (the head's prior, `adaptive.COST_PRIORS`, less a head step), not a measurement;
# greedy runs refine it by the clock.
LOOKUP_COST = {"gpu": (1.15, 0.1), "cpu": (1.45, 0.5)}


def find_continuation(history: np.ndarray, n: int, depth: int) -> list[int]:
    """The up to `depth` tokens after the most recent earlier occurrence of `history`'s
    last `n` tokens (none: [])."""
    if len(history) <= n:
        return []
    suffix = history[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    if hits.size == 0:
        return []
    start = int(hits[-1]) + n
    return history[start : start + depth].tolist()


class PromptLookupProposer(ProposerBase):
    """Proposes from the prompt and the output so far (see the module's text); `vocab`: the
    width of the target's logits (the one-hot distributions when sampling)."""

    name = "prompt-lookup"

    def __init__(self, vocab: int, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise MtpkitError(
                f"prompt lookup needs 1 <= --prompt-lookup-min <= --prompt-lookup-max, "
                f"not {min_n} and {max_n}"
            )
        self.vocab, self.min_n, self.max_n = vocab, min_n, max_n
        self.history = np.zeros(0, dtype=np.int64)
        self.prefilling = False

    def begin(self, prompt: list[int], cached: int) -> None:
        self.history = np.asarray(prompt, dtype=np.int64)
        self.prefilling = True

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        if not self.prefilling:  # a plain step's token (the prompt's are in `begin`)
            self.history = np.append(self.history, tokens)

    def end_prefill(self) -> None:
        self.prefilling = False

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal | None:
        for n in range(self.max_n, self.min_n - 1, -1):
            drafts = find_continuation(self.history, n, depth)
            if drafts:
                dists = None if sampling.greedy else one_hot(drafts, self.vocab)
                return Proposal(mx.array(drafts, dtype=mx.int32), dists)
        return None

    def settle(self, state: object, verdict: Verdict, premise_held: bool) -> None:
        self.history = np.append(self.history, verdict.confirmed)

    def cost_prior(self, depth: int) -> float | None:
        kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
        base, per_depth = LOOKUP_COST[kind]
        return base + per_depth * (depth - 1)
