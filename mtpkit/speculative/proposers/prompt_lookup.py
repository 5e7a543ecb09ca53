"""Prompt lookup (vLLM's n-gram proposer): the tokens that followed the most recent earlier
occurrence of the text's last n tokens propose the next ones, for n from `max_n` down to
`min_n`. No weights and no device work: code edits, retrieval answers and summaries repeat
their context. A step with no match is a plain step, so the lookup costs only the search.
It proposes deterministically, so when sampling each draft's distribution is one-hot and
exact rejection sampling keeps a draft with the target's own probability of it.

In a batch (`LookupRows`) each row looks up its own prompt and output: rows find drafts of
different lengths (a row that finds none takes a plain step inside the round), and the
drafts are host values, so each round is read before the next is built.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtpkit.core.errors import MtpkitError
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import (
    Proposal,
    ProposerBase,
    RowsBase,
    RowsProposal,
    one_hot,
)

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


def look_up(history: np.ndarray, depth: int, min_n: int, max_n: int) -> list[int]:
    """Up to `depth` drafts after the longest of `history`'s last `max_n`..`min_n` tokens
    that occurred before (none: [])."""
    for n in range(max_n, min_n - 1, -1):
        drafts = find_continuation(history, n, depth)
        if drafts:
            return drafts
    return []


class PromptLookupProposer(ProposerBase):
    """Proposes from the prompt and the output so far (see the module's text); `vocab`: the
    width of the target's logits (the one-hot distributions when sampling)."""

    name = "prompt-lookup"
    batches = True

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
        drafts = look_up(self.history, depth, self.min_n, self.max_n)
        if not drafts:
            return None
        dists = None if sampling.greedy else one_hot(drafts, self.vocab)
        return Proposal(mx.array(drafts, dtype=mx.int32), dists)

    def settle(self, state: object, verdict: Verdict, premise_held: bool) -> None:
        self.history = np.append(self.history, verdict.confirmed)

    def cost_prior(self, depth: int) -> float | None:
        kind = "gpu" if mx.default_device() == mx.gpu else "cpu"
        base, per_depth = LOOKUP_COST[kind]
        return base + per_depth * (depth - 1)

    def batched(self) -> LookupRows:
        return LookupRows(self)


class LookupRows(RowsBase):
    """Prompt lookup for the rows of a batch: each row's own token history (see the
    module's text)."""

    name = "prompt-lookup"

    def __init__(self, first: PromptLookupProposer) -> None:
        self.vocab, self.min_n, self.max_n = first.vocab, first.min_n, first.max_n
        self.histories: list[np.ndarray] = [first.history]

    def join(self, proposer: PromptLookupProposer) -> None:
        self.histories.append(proposer.history)

    def keep(self, index: list[int]) -> None:
        self.histories = [self.histories[i] for i in index]

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        for r, token in enumerate(tokens.reshape(-1).tolist()):
            self.histories[r] = np.append(self.histories[r], token)

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """Row r's drafts, up to `depths[r]`, padded to the longest row's (a row verifies
        only its own)."""
        found = [
            look_up(h, d, self.min_n, self.max_n) if d else []
            for h, d in zip(self.histories, depths, strict=True)
        ]
        width = max(len(f) for f in found)
        padded = [f + [0] * (width - len(f)) for f in found]
        drafts = mx.array(padded, dtype=mx.int32).reshape(len(found), width)
        dists = [
            one_hot(f, self.vocab) if f and not s.greedy else None
            for f, s in zip(found, sampling, strict=True)
        ]
        return RowsProposal(drafts, [len(f) for f in found], dists)

    def settle(self, state: object, kept: list[int], confirmed: list[list[int]]) -> None:
        self.histories = [
            np.append(h, tokens) for h, tokens in zip(self.histories, confirmed, strict=True)
        ]

    def take(self, r: int, tokens: list[int]) -> PromptLookupProposer:
        proposer = PromptLookupProposer(self.vocab, self.min_n, self.max_n)
        proposer.begin(tokens, len(tokens))  # its history: the row's prompt and output
        proposer.end_prefill()
        return proposer
