"""Oracle drafts for `mtpkit bench --acceptance A`: a controlled acceptance at a real shape.

The head still runs and costs what it costs, but the token it drafts at each depth is
replaced: with probability A by the backbone's own next token, taken from a plain greedy pass
over the same prompt (so the verify pass keeps it), else by a wrong one. The choice at each
(position, depth) is a seeded hash of both, not a draw from a shared stream, so a pipelined
round that is queued, discarded and built again gets the same drafts. Figures measured so
are synthetic: they say what a head of that acceptance would gain, not what any head does.
"""

from __future__ import annotations

import random

import mlx.core as mx


class OracleDrafts:
    """A `MtpDecoder.draft_filter`: right with probability `acceptance` at each depth."""

    def __init__(
        self, reference: list[int], prompt_length: int, acceptance: float, vocab: int, seed: int = 0
    ) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], not {acceptance}")
        self.reference = reference  # the greedy continuation of the prompt
        self.prompt_length = prompt_length
        self.acceptance = acceptance
        self.vocab = vocab
        self.seed = seed

    def right(self, index: int, depth: int) -> bool:
        u = random.Random(f"{self.seed}:{index}:{depth}").random()
        return u < self.acceptance

    def __call__(self, position: int, head_drafts: mx.array) -> mx.array:
        start = position - self.prompt_length
        drafts = []
        for j in range(head_drafts.shape[0]):
            i = start + j
            truth = self.reference[i] if i < len(self.reference) else 0
            drafts.append(truth if self.right(i, j) else (truth + 1) % self.vocab)
        # The head's drafts stay in the graph (never negative): its cost is paid.
        return mx.where(head_drafts < 0, head_drafts, mx.array(drafts, dtype=mx.int32))
