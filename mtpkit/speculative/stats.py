"""A decode's counts, as one stream and each row of a batch keep them: rounds, drafts and
acceptance per depth, the draft log, and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from mtpkit.core.choices import MAX_DEPTH


@dataclass
class Stats:
    prompt_tokens: int = 0
    proposer: str = "mtp"  # which proposer drafted (`Proposer.name`)
    cached_tokens: int = 0  # prompt tokens a reused cache held (not prefilled)
    depth: int = 1  # the deepest a round drafts at
    depth_chosen: bool = False  # adaptive drafting chose each round's
    generated: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    drafted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    # As mlx-lm reports them: the prompt's time runs to the first output (for MTP, the first
    # round), the decode rate counts the tokens after it.
    prompt_time: float = 0.0
    decode_time: float = 0.0
    decode_tokens: int = 0
    rounds: int = 0
    rounds_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    last_accepted: int = 0
    plain_steps: int = 0
    pipelined: int = 0  # rounds built before the previous verdict was read
    discarded: int = 0  # of those, thrown away after a rejection
    launched_ahead: int = 0  # of the pipelined, those launched before that read
    # (position in prompt + output of the first draft, the drafts) for every round.
    draft_log: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def acceptance_by_depth(self, depth: int) -> list[float | None]:
        drafted, accepted = self.drafted_by_depth, self.accepted_by_depth
        return [
            accepted[i] / drafted[i] if i < len(drafted) and drafted[i] else None
            for i in range(depth)
        ]

    def _reach(self, depth: int) -> None:
        """Counts up to `depth`: a block drafter's rounds go past MAX_DEPTH (the head's
        chain), up to its block size."""
        for counts in (self.drafted_by_depth, self.accepted_by_depth, self.rounds_by_depth):
            counts.extend([0] * (depth - len(counts)))

    def record_round(self, position: int, drafts: list[int], accepted: int) -> None:
        self.draft_log.append((position, drafts))
        self.last_accepted = accepted
        self._count(drafts, accepted, +1)
        self.rounds += 1
        self._reach(len(drafts))
        self.rounds_by_depth[len(drafts) - 1] += 1

    def end_round_at(self, kept: int) -> None:
        """The last round's output ended after `kept` of its tokens (at an EOS): drafts from
        there on, the EOS among them, count as neither drafted nor accepted."""
        position, drafts = self.draft_log[-1]
        if kept >= self.last_accepted:
            return  # the EOS was the round's own next token, not a draft
        self._count(drafts, self.last_accepted, -1)
        self.draft_log[-1] = (position, drafts[:kept])
        self.last_accepted = kept
        self._count(drafts[:kept], kept, +1)

    def _count(self, drafts: list[int], accepted: int, sign: int) -> None:
        self._reach(len(drafts))
        self.drafted += sign * len(drafts)
        self.accepted += sign * accepted
        for j in range(min(accepted + 1, len(drafts))):
            self.drafted_by_depth[j] += sign
            self.accepted_by_depth[j] += sign if j < accepted else 0
