"""The bench's prompt prefilled once per load and forked for every run.

Every bench run decodes after the same prompt, and none times its prefill (stock mlx-lm's
`generation_tps` starts at the first token, `speed.mtp_run` after the first round). Yet
each run prefilled it again: at 4096 tokens on MLX's CUDA build, where mlx-lm updates a
gated-delta-net layer token by token in Python (its kernel is Metal's only), that was ~10 s a
run and 70+ runs a shape, so `bench --prompt-tokens 4096` on four shapes did not fit a GPU
lease (H100, 2026-11-27: 0.8b ran 4 of 5 trials in 15 minutes). Now each model prefills the
prompt once, as its own path does it (stock: mlx-lm's model in chunks of 2048, as
`generate_step`; mtpkit: `MtpDecoder.prefill`, the proposer observing), and each run continues
from a fork (`fork_cache`: handles on MLX's immutable arrays, so a run's first write copies
what it changes and the prefilled state stays as it was). A run is then what a prompt-cache
hit is to `mlx_lm.server` and to `mtpkit serve`: stock's caches hold all but the prompt's last
token, which is its first input; mtpkit's hold one token fewer, so every run still prefills
one token and its proposer observes it (Gemma 4's assistant drafts from the hidden state a
prefill leaves, which a fork with nothing left to prefill would not have).

Where a cache cannot be forked, or ranks decode in lockstep (each rank's caches are its own
stage's), `Prefilled` hands out nothing and every run prefills as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.runtime.model import MtpModel, untapped
from mtpkit.runtime.rollback.state import can_fork, fork_cache
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.prompt_cache import CachedState
from mtpkit.speculative.proposers import Proposer

STEP = 2048  # tokens per prefill forward (mlx-lm's default prefill_step_size)
MtpState = tuple[list[Any], Proposer, int]


class Prefilled:
    """The prompt's state per model and per proposer kind, made on first use."""

    def __init__(self, m: MtpModel, prompt: list[int], *, enabled: bool = True) -> None:
        self.m, self.prompt = m, prompt
        self.enabled = enabled and m.lockstep.size == 1 and len(prompt) > 1
        self._stock: dict[int, list[Any] | None] = {}
        self._mtp: dict[str, tuple[list[Any], Proposer] | None] = {}

    def stock_cache(self, model: nn.Module) -> list[Any] | None:
        """A fork of mlx-lm's cache of `model` after all but the prompt's last token (None:
        the run prefills)."""
        if not self.enabled:
            return None
        if id(model) not in self._stock:
            self._stock[id(model)] = self._stock_prefill(model)
        cache = self._stock[id(model)]
        return [fork_cache(c) for c in cache] if cache is not None else None

    def _stock_prefill(self, model: nn.Module) -> list[Any] | None:
        from mlx_lm.generate import generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        if not can_fork(cache):
            return None
        rest = self.prompt[:-1]
        with untapped(self.m.final_norm), mx.stream(generation_stream):
            for i in range(0, len(rest), STEP):
                model(mx.array(rest[i : i + STEP])[None], cache=cache)
                mx.eval([c.state for c in cache])
                mx.clear_cache()
        return cache

    def mtp_state(self, name: str, fresh: Callable[[], Proposer]) -> MtpState | None:
        """(cache, proposer, cached) for an `MtpDecoder`: forks of the target's caches and of
        a `name` proposer (`fresh` makes the one that prefills) after `MtpDecoder.prefill` of
        the prompt but its last token, as a session's prompt cache keeps them (the target
        has consumed all but the last two tokens, which `cached` counts). None: the run
        prefills."""
        if not self.enabled or len(self.prompt) < 3:
            return None
        if name not in self._mtp:
            self._mtp[name] = self._mtp_prefill(fresh())
        kept = self._mtp[name]
        if kept is None:
            return None
        cache, proposer = kept
        return [fork_cache(c) for c in cache], proposer.fork(), len(self.prompt) - 2

    def cache_entry(self, name: str, fresh: Callable[[], Proposer]) -> CachedState | None:
        """`mtp_state` as a prompt-cache entry (`BatchDecoder.add(cached=)`): its tokens are
        the prompt but the last, which the proposer has seen and the target all but one of."""
        state = self.mtp_state(name, fresh)
        if state is None:
            return None
        cache, proposer, cached = state
        return CachedState(tuple(self.prompt[: cached + 1]), cache, proposer, name)

    def _mtp_prefill(self, proposer: Proposer) -> tuple[list[Any], Proposer] | None:
        decoder = MtpDecoder(
            self.m, self.prompt[:-1], depth=1, sampling=SamplingSettings(), adaptive=False,
            pipeline=False, proposer=proposer,
        )  # fmt: skip
        if not can_fork(decoder.cache):
            return None
        decoder.prefill()
        return [fork_cache(c) for c in decoder.cache], proposer.fork()
