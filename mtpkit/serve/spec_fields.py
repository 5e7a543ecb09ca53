"""vLLM's per-request speculative-decoding figures (`--per-request-spec-decode-metrics
summary`, vllm-project/vllm#48915): a response's `metrics.speculative_decoding`, beside
mtpkit's `mtp` object, in the non-streamed body and in a stream's last chunks.

As vLLM defines them: a step is a drafting round (a verify pass); the mean acceptance
length counts the token each step adds of its own (1 + accepted drafts per step); the
histogram counts the steps that kept 0, 1, ... `num_spec_tokens` drafts.
"""

from __future__ import annotations

from pydantic import BaseModel

from mtpkit.speculative.stats import Stats


class SpeculativeDecoding(BaseModel):
    mean_acceptance_length: float | None  # None: no drafting round ran
    draft_acceptance_rate: float | None  # None: nothing drafted
    acceptance_histogram: list[int]
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int

    @classmethod
    def from_stats(cls, stats: Stats) -> SpeculativeDecoding:
        steps, depth = stats.rounds, stats.depth
        # accepted_by_depth[j] counts the steps that kept a draft at depth j, so at least
        # j + 1 drafts: the steps that kept exactly j are the differences.
        at_least = [steps, *stats.accepted_by_depth[:depth]]
        histogram = [at_least[j] - (at_least[j + 1] if j < depth else 0) for j in range(depth + 1)]
        return cls(
            mean_acceptance_length=1 + stats.accepted / steps if steps else None,
            draft_acceptance_rate=stats.acceptance,
            acceptance_histogram=histogram,
            num_spec_steps=steps,
            num_accepted_draft_tokens=stats.accepted,
            num_draft_tokens=stats.drafted,
            num_spec_tokens=depth,
        )

    def accepted_per_position(self) -> list[int]:
        """Steps whose draft at each position was kept (vLLM's
        `spec_decode_num_accepted_tokens_per_pos`)."""
        return [sum(self.acceptance_histogram[j + 1 :]) for j in range(self.num_spec_tokens)]
