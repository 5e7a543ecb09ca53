"""Oracle drafts for `mtpkit bench --acceptance A`: a controlled acceptance at a real shape.

The head still runs and costs what it costs, but the token it drafts at each depth is
replaced: by the backbone's own next token, taken from a plain greedy pass over the same
prompt (so the verify pass keeps it) where the plan says right, else by a wrong one. The
plan: round r keeps its draft at depth j when a seeded golden-ratio (Weyl) sequence, one per
depth, is below A at r, so that even a 128-token run realizes A closely (independent draws
at A = 0.8 realized 0.75 over 73 rounds; the same sequence over positions realized 0.73,
since a kept draft skips a position). r counts the rounds whose verdict is read, so a
pipelined round that is queued and discarded takes no place in it.

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
    from mtpkit.speculative.decode import MtpDecoder, Round


GOLDEN = (5**0.5 - 1) / 2  # the Weyl sequence's step: the most evenly spread


class OracleDrafts:
    """A `MtpDecoder.draft_filter` and verdict: right at a share `acceptance` at each depth.
    The drafts follow the plan of the next round to be read (a round queued ahead may get its
    predecessor's); what is kept is decided by the plan in `read_verdict` alone."""

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
        self.rounds = 0  # verdicts read so far

    def planned(self, round_index: int, depth: int) -> int:
        """Drafts planned right, in a row, for the `round_index`-th round read."""
        kept = 0
        while kept < depth and self.right(round_index, kept):
            kept += 1
        return kept

    def read_verdict(self, decoder: MtpDecoder) -> Callable[[Round], tuple[int, int, list[int]]]:
        """A replacement for `decoder.read_round_verdict` (greedy): the planned count kept,
        the backbone's own token after them."""

        def read(r: Round) -> tuple[int, int, list[int]]:
            values = r.packed.tolist()
            k = r.depth
            targets, drafts = values[: k + 1], values[k + 1 :]
            kept = self.planned(self.rounds, k)
            self.rounds += 1
            return kept, targets[kept], drafts

        return read

    def right(self, round_index: int, depth: int) -> bool:
        offset = random.Random(f"{self.seed}:{depth}").random()
        return (offset + round_index * GOLDEN) % 1.0 < self.acceptance

    def __call__(self, position: int, head_drafts: mx.array) -> mx.array:
        start = position - self.prompt_length
        drafts = []
        for j in range(head_drafts.shape[0]):
            i = start + j
            truth = self.reference[i] if i < len(self.reference) else 0
            drafts.append(truth if self.right(self.rounds, j) else (truth + 1) % self.vocab)
        # The head's drafts stay in the graph (never negative): its cost is paid.
        return mx.where(head_drafts < 0, head_drafts, mx.array(drafts, dtype=mx.int32))
