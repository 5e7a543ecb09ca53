"""One request in a batch (`Row`): its prompt, its sampling settings and PRNG key, the tokens
confirmed for it, its counts, and why it ended; and a row between its first token and its
merge into the batch (`Joining`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.adaptive import AdaptiveDrafting
from mtpkit.speculative.stats import Stats

GREEDY = SamplingSettings()
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass
class Row:
    """One request in the batch: its prompt, what it has confirmed, and why it ended."""

    uid: int
    prompt: list[int]
    max_tokens: int
    sampling: SamplingSettings = GREEDY
    depth: int = 1  # drafts it verifies a round (0: drafting off, a plain step each round)
    # The row's own PRNG key (from its seed): its draws, alone or in any batch, are the same.
    key: mx.array | None = None
    # A request without a depth: its depth chosen from its own verdicts, as one stream's
    # adaptive drafting chooses it (`choose_depth`, by counts only: no clock, no batchmate).
    chooser: AdaptiveDrafting | None = None
    tokens: list[int] = field(default_factory=list)  # confirmed output, EOS excluded
    # Its output and the EOS that ended it (a queued plain step's token past an EOS too):
    # its caches hold the prompt and these but the last (what a prompt cache's entry keeps).
    decoded: list[int] = field(default_factory=list)
    finish: str | None = None  # STOP, LENGTH or CANCELLED once done
    last: int = 0  # the last confirmed token; the backbone has not consumed it yet
    # Its rounds counted as one stream counts them (per depth; drafts past an EOS left out);
    # `stats.draft_log`: (position in prompt + output of the first draft, the drafts).
    stats: Stats = field(default_factory=Stats)

    @property
    def drafted(self) -> int:
        return self.stats.drafted

    @property
    def accepted(self) -> int:
        return self.stats.accepted

    @property
    def rounds(self) -> int:
        return self.stats.rounds

    @property
    def draft_log(self) -> list[tuple[int, list[int]]]:
        return self.stats.draft_log

    @property
    def position(self) -> int:
        """Prompt and output tokens before the next draft (the last confirmed included)."""
        return len(self.prompt) + len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def choose_next(self, drafts: int, accepted: int) -> None:
        """After a step in which the row verified `drafts` drafts (0: a plain step) and kept
        `accepted`, its depth for the next rounds as its chooser decides (0: a plain stretch)."""
        chooser = self.chooser
        if chooser is None:
            return
        if drafts:
            chooser.record_round(1 + accepted, depth=drafts)
        else:
            chooser.record_plain(0.0)
        self.depth = chooser.next_depth() if chooser.want_draft() else 0

    def next_keys(self, n: int) -> list[mx.array | None]:
        """Keys for the row's next `n` draws (None each without a seed)."""
        if self.key is None:
            return [None] * n
        keys = mx.random.split(self.key, n + 1)
        self.key = keys[0]
        return [keys[i] for i in range(1, n + 1)]


@dataclass
class Joining:
    """A row prefilled, its first token confirmed, not merged into the batch yet: its caches,
    its proposer (its state), the first token's pair (hidden state [1, 1, H], token) and, while the
    head has not caught up with the prompt, the target's caches as the prefill left them
    (for the prompt cache's entry of the prompt). Where the head defers its catch-up (a
    long prompt: `HeadProposer.defers_catch_up`), the row waits here until the next step,
    so that its first token goes out before the catch-up, as one stream's does."""

    row: Row
    cache: list[Any]
    proposer: Any  # Proposer | None
    pair: tuple[mx.array, int]
    prefilled: list[Any] | None = None

    def catch_up(self, prompt_cache: Any, name: str) -> None:
        """The proposer's deferred catch-up with the prompt, then the prompt's entry in
        `prompt_cache` (a `PromptCache`, or None) for drafter `name`."""
        if self.prefilled is None:
            return
        self.proposer.end_prefill()
        if prompt_cache is not None:
            prompt_cache.store(self.row.prompt, self.prefilled, self.proposer, name)
        self.prefilled = None
