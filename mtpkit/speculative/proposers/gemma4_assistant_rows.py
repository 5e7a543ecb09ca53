"""Gemma 4's assistant drafting for the rows of a batch (`AssistantRows`): the batched side
of `gemma4_assistant.AssistantProposer`.

The assistant owns no cache, so a row brings only what it drafts from: the target's
final-normed hidden state before its last confirmed token and that token. Each round it
reads the batch's target caches as the decoder left them (each row rolled back to its own
kept prefix: `runtime.rollback.rows`), one pass for every row: mlx-lm's batched caches hold
the rows right-aligned on one write index, a window read in temporal order
(`mtpkit.mlxlm.batch_keys_values`), so row r attends over its own entries only (those after
its left padding, and in a sliding layer the last `window + 1` of them, as one stream's
`Gemma4AssistantModel.masks`), with its query at its own last confirmed index (the full
layer's per-row `offset`, RoPE per row). A row's window holds what its one stream's would
(`window` entries after a one-token step, `window - 1` and its kept ones after a round:
`held`), so its drafts are the ones it drafts alone. Settling keeps each row's target
state at its last kept verify input; the target's rollback is the decoder's. The rollback
of a sliding window takes counts the host has read, so each round is read before the next
is built.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.runtime.draft_vocab import FullVocab
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.proposers.base import RowsBase, RowsProposal, draw_rows
from mtpkit.speculative.proposers.gemma4_assistant import AssistantProposer


class AssistantRows(RowsBase):
    """The assistant drafting for every row of a batch (see the module's text)."""

    name = "gemma4-assistant"

    def __init__(self, first: AssistantProposer) -> None:
        self.m, self.assistant, self.reader = first.m, first.assistant, first.reader
        self.step_cost = first.step_cost
        self.full = FullVocab(None)  # draws over the target's ids, as they are
        self.window = first.assistant.sliding_window
        self.target_cache: list[Any] = []
        self.hidden, self.last = _row_state(first)  # [B, 1, H_b], [B, 1]
        # The sliding-window entries each row's one stream would hold (`_sliding_starts`).
        self.held: list[int] = [self.window]

    def attach(self, cache: list[Any]) -> None:
        self.target_cache = cache

    def join(self, proposer: AssistantProposer) -> None:
        hidden, last = _row_state(proposer)
        self.hidden = mx.concatenate([self.hidden, hidden])
        self.last = mx.concatenate([self.last, last])
        self.held.append(self.window)  # its first token took a one-token step

    def keep(self, index: list[int]) -> None:
        rows = mx.array(index, dtype=mx.int32)
        self.hidden, self.last = self.hidden[rows], self.last[rows]
        self.held = [self.held[i] for i in index]

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        self.hidden, self.last = hidden, tokens.astype(mx.int32)
        self.held = [self.window] * len(self.held)  # a one-token step keeps the window

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """The deepest row's count of drafts for every row [B, K] (lazy)."""
        depth = max(depths)
        if depth == 0:  # every row's drafting is off: a plain step for all
            return RowsProposal.plain(depths)
        kv, starts = self.reader.rows_kv(self.target_cache)
        if "sliding_attention" in kv:
            starts["sliding_attention"] = self._sliding_starts(kv, starts)
        masks = self.assistant.row_masks(kv, starts)
        positions = self.target_cache[self.reader.sources["full_attention"]].offset
        greedy = all(s.greedy for s in sampling)
        token, hidden = self.last, self.hidden
        drafts: list[mx.array] = []
        dists: list[list[mx.array]] = [[] for _ in sampling]
        for k in range(depth):
            embedded = self.reader.embed(token)
            h, hidden = self.assistant.hidden_step(
                embedded, hidden.astype(embedded.dtype), kv, positions, masks
            )
            if greedy:  # the masked head's argmax without its full-vocabulary logits
                drafted = self.assistant.greedy(h)[:, -1].astype(mx.int32)
            else:
                logits = self.assistant.logits(h)[:, -1]
                drafted = draw_rows(self.full, logits, sampling, [r[k] for r in keys], dists)
            drafts.append(drafted)
            token = drafted[:, None]
        rows = [mx.stack(d) if d else None for d in dists]
        return RowsProposal(mx.stack(drafts, axis=1), depths, rows)

    def after_verify(
        self, proposal: RowsProposal, hidden: mx.array, followers: mx.array
    ) -> mx.array:
        return hidden  # the target's states at every verify input [B, K+1, H_b]

    def settle(self, state: mx.array, kept: list[int], confirmed: list[list[int]]) -> None:
        """The next round drafts from each row's target state at its last kept input."""
        index = mx.array(kept, dtype=mx.int32)[:, None, None] - 1
        self.hidden = mx.take_along_axis(state, index, axis=1)
        self.last = mx.array([[tokens[-1]] for tokens in confirmed], dtype=mx.int32)
        # A pass of several tokens keeps `window - 1` older entries, then the row's kept ones.
        self.held = [self.window - 1 + k for k in kept]

    def _sliding_starts(self, kv: dict[str, Any], starts: dict[str, mx.array]) -> mx.array:
        """Where each row's sliding-window entries start: after its left padding, and no
        older than the entries its one stream would hold (`held`). A row that kept fewer
        inputs than another was rolled right by the rest, and once a window's trim has cut
        into a row's entries (its `left_padding` below 0) the padding no longer counts the
        rejected entries rolled in before them."""
        length = kv["sliding_attention"][0].shape[-2]
        held = mx.array(self.held, dtype=mx.int32)
        return mx.maximum(starts["sliding_attention"], length - held)

    def take(self, r: int, tokens: list[int]) -> AssistantProposer:
        """Row r as one stream's proposer: its hidden state and last token (`tokens`: its
        prompt and output; the target's cache is the session's to attach)."""
        proposer = AssistantProposer(self.m, self.assistant, self.step_cost)
        proposer.hidden = self.hidden[r : r + 1]
        proposer.last_token = tokens[-1]
        return proposer


def _row_state(proposer: AssistantProposer) -> tuple[mx.array, mx.array]:
    """A joining row's target state before its last confirmed token [1, 1, H_b] and that
    token [1, 1] (it has observed its first token's pair)."""
    assert proposer.hidden is not None, "a row joins after its first token"
    return proposer.hidden, mx.array([[proposer.last_token]], dtype=mx.int32)
