"""bench's costs stage ("forward and head costs"): a 1-token forward, verify passes of 2..K+1
tokens (with mtpkit's gated-delta-net snapshots, as decoding runs them) and a head step,
timed interleaved at the prompt's position. beta and delta (`mtpkit.bench.speed`) are their
ratios to the 1-token forward."""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from mtpkit.bench.report import Costs, Figure
from mtpkit.runtime.model import MtpModel, is_recurrent_cache


class ForwardTimer:
    """Times backbone forwards of n tokens at a fixed cache position, undoing each one."""

    def __init__(self, m: MtpModel, prompt: list[int]) -> None:
        self.m = m
        self.cache = m.make_cache()
        m.model(mx.array(prompt)[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.saved = [list(c.cache) if is_recurrent_cache(c) else None for c in self.cache]
        self.token = prompt[-1]

    def forward(self, n: int) -> None:
        tokens = mx.array([self.token] * n)
        if n > 1:  # a verify pass, with its gated-delta-net snapshots, as decoding runs it
            verified = self.m.verify(tokens, self.cache)
            snapshots = verified.snapshots.states if verified.snapshots else []
            mx.eval(verified.logits, verified.hidden, snapshots)
        else:
            mx.eval(*self.m.forward(tokens[None], self.cache))
        self.undo(n)

    def undo(self, n: int) -> None:
        """Take the last forward of `n` tokens back out of the caches."""
        for c, saved in zip(self.cache, self.saved, strict=True):
            if saved is None:
                c.trim(n)
            else:
                c.cache = list(saved)


def measure_costs(m: MtpModel, prompt: list[int], *, max_depth: int, repeats: int = 20) -> Costs:
    """Interleaved per repeat: a 1-token forward, verifies of 2..K+1 tokens, a head step."""
    timer = ForwardTimer(m, prompt)
    head_step = _head_step(m, prompt) if m.head is not None else None
    steps: list[tuple[int, Callable[[], None]]] = [(0, lambda: timer.forward(1))]
    steps += [(k, lambda k=k: timer.forward(k + 1)) for k in range(1, max_depth + 1)]
    if head_step is not None:
        steps.append((-1, head_step))
    for _, fn in steps:  # warm up
        fn()
    costs = Costs(verify={k: Figure() for k in range(1, max_depth + 1)})
    for _ in range(repeats):
        seconds = {}
        for key, fn in steps:
            t0 = time.perf_counter()
            fn()
            seconds[key] = time.perf_counter() - t0
        one = seconds[0]
        costs.one.values.append(one)
        for k in range(1, max_depth + 1):
            costs.verify[k].values.append(seconds[k] / one)
        if head_step is not None:
            costs.delta.values.append(seconds[-1] / one)
    return costs


def _head_step(m: MtpModel, prompt: list[int]) -> Callable[[], None]:
    """One head step (block, final norm, lm_head over the draft vocabulary, argmax) at the
    prompt's position."""
    head = m.head
    token = mx.array([[prompt[-1]]])
    dtype = m.embed(token).dtype
    h = mx.random.normal((1, 1, _hidden_size(m))).astype(dtype)
    cache = head.make_cache()
    warm = head(mx.repeat(h, len(prompt), axis=1), m.embed(mx.array(prompt)[None]), cache)
    mx.eval(warm)

    def step() -> None:
        x = head(h, m.embed(token), cache)
        logits = m.drafting.logits(head.final_norm(0)(x))
        mx.eval(m.drafting.token(mx.argmax(logits, axis=-1)))
        for c in cache:
            c.trim(1)

    return step


def _hidden_size(m: MtpModel) -> int:
    text = m.config.get("text_config") or m.config
    return int(text["hidden_size"])
