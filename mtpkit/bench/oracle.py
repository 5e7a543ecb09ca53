"""Oracle drafts for `mtpkit bench --acceptance A`: a controlled acceptance at a real shape.

The head still runs and costs what it costs, but the token it drafts at each depth is
replaced: with probability A by the backbone's own next token, taken from a plain greedy pass
over the same prompt (so the verify pass keeps it), else by a wrong one. The choice at each
(position, depth) is a seeded hash of both, not a draw from a shared stream, so a pipelined
round that is queued, discarded and built again gets the same drafts.

The verdict is held to the plan too (`read_verdict`): a random-weight model's logits are
nearly tied, so its multi-token verify pass and stock's one-token steps part ways within a
few tokens on a GPU (bf16), after which no reference token would be accepted again. The
round keeps exactly the planned drafts and the backbone's token after them, so the verify
pass, the rollback and the head's steps cost what a head of acceptance A costs. Figures
measured so are synthetic: what a head of that acceptance would gain, not what any head does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:
    from mtpkit.spec.decode import MtpDecoder, Round


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

    def planned(self, position: int, depth: int) -> int:
        """Drafts planned right, in a row, for the round at `position`."""
        start = position - self.prompt_length
        kept = 0
        while kept < depth and self.right(start + kept, kept):
            kept += 1
        return kept

    def read_verdict(self, decoder: MtpDecoder) -> Callable[[Round], tuple[int, int, list[int]]]:
        """A replacement for `decoder.read_round_verdict` (greedy): the planned count kept,
        the backbone's own token after them."""

        def read(r: Round) -> tuple[int, int, list[int]]:
            values = r.packed.tolist()
            k = decoder.depth
            targets, drafts = values[: k + 1], values[k + 1 :]
            kept = self.planned(r.position, k)
            return kept, targets[kept], drafts

        return read

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
