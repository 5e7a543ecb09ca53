"""The prompt cache a session keeps between requests: the target's caches and the proposer's
state after a sequence of tokens, reused by the next request whose prompt starts with it (a
conversation's next turn prefills only its new tokens, as `mlx_lm.server`'s LRU prompt cache
does). An entry is a fork (`rollback.state.fork_cache`): handles on MLX's immutable arrays,
so keeping one copies nothing until either side writes.

An entry's `tokens` are the sequence whose state it holds: the target has consumed all but
the last, the proposer has seen them all (the head holds the pair of the last as pending).
Any cache kind can continue from an entry; none is trimmed back, so an entry is reused only
by a prompt that extends its tokens exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mtpkit.runtime.rollback.state import can_fork, fork_cache
from mtpkit.speculative.proposers import Proposer

DEFAULT_SIZE = 10  # entries (mlx_lm.server's --prompt-cache-size default)


@dataclass
class CachedState:
    tokens: tuple[int, ...]
    cache: list[Any]
    proposer: Proposer | None
    proposer_name: str

    def fork(self) -> tuple[list[Any], Proposer | None]:
        proposer = self.proposer.fork() if self.proposer is not None else None
        return [fork_cache(c) for c in self.cache], proposer


class PromptCache:
    """Up to `size` entries, least recently used first out (0: none kept)."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self.size = size
        self.entries: OrderedDict[tuple[int, ...], CachedState] = OrderedDict()

    def store(
        self, tokens: list[int], cache: list[Any], proposer: Proposer | None, proposer_name: str
    ) -> None:
        if self.size <= 0 or len(tokens) < 2 or not can_fork(cache):
            return
        key = tuple(tokens)
        forked = proposer.fork() if proposer is not None else None
        state = CachedState(key, [fork_cache(c) for c in cache], forked, proposer_name)
        self.entries[key] = state
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def longest_prefix(self, prompt: list[int], proposer_name: str) -> CachedState | None:
        """The entry of the longest token sequence that `prompt` starts with, made by the
        same kind of proposer (None: no entry fits)."""
        best = None
        for key, state in self.entries.items():
            fits = len(key) <= len(prompt) and tuple(prompt[: len(key)]) == key
            if fits and state.proposer_name == proposer_name:
                if best is None or len(key) > len(best.tokens):
                    best = state
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def clear(self) -> None:
        self.entries.clear()
