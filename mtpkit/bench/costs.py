"""bench's costs stage ("forward and head costs"): a 1-token forward, verify passes of 2..K+1
tokens (with mtpkit's gated-delta-net snapshots, as decoding runs them) and a head step,
timed interleaved at the prompt's position. beta and delta (`mtpkit.bench.speed`) are their
ratios to the 1-token forward.

With a block drafter, also one drafter pass per depth K its rows draft at (and the verify of
K+1 tokens): a proposal of K after the prompt, as a round makes it (its drafts through the
target's lm_head included), from a fork of the drafter's state after the prompt that has
seen one more confirmed position, as a round's drafter has. Its target is tapped before any
timing, so each verify is timed with the taps a block drafter's decoding runs with."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from mtpkit.bench.report import Costs, Figure
from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import MtpModel, is_recurrent_cache
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.proposers.base import Proposal, Proposer


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


def measure_costs(
    m: MtpModel,
    prompt: list[int],
    *,
    max_depth: int,
    repeats: int = 20,
    drafter: Callable[[], Proposer] | None = None,
    drafter_depths: Sequence[int] = (),
) -> Costs:
    """Interleaved per repeat: a 1-token forward, verifies of 2..K+1 tokens, a head step;
    with `drafter` (a block drafter's proposer factory) a pass at each of `drafter_depths`
    and the verifies of those depths too."""
    timer = ForwardTimer(m, prompt)
    head_step = _head_step(m, prompt) if m.head is not None else None
    drafter_pass = _drafter_pass(m, prompt, drafter, drafter_depths) if drafter else None
    depths = sorted(set(range(1, max_depth + 1)) | set(drafter_depths))
    steps: list[tuple[object, Callable[[], None]]] = [(0, lambda: timer.forward(1))]
    steps += [(k, lambda k=k: timer.forward(k + 1)) for k in depths]
    if head_step is not None:
        steps.append((-1, head_step))
    if drafter_pass is not None:
        steps += [(("pass", k), lambda k=k: drafter_pass(k)) for k in drafter_depths]
    for _, fn in steps:  # warm up
        fn()
    costs = Costs(verify={k: Figure() for k in depths})
    costs.drafter = {k: Figure() for k in drafter_depths} if drafter_pass is not None else {}
    for _ in range(repeats):
        seconds = {}
        for key, fn in steps:
            t0 = time.perf_counter()
            fn()
            seconds[key] = time.perf_counter() - t0
        one = seconds[0]
        costs.one.values.append(one)
        for k in depths:
            costs.verify[k].values.append(seconds[k] / one)
        if head_step is not None:
            costs.delta.values.append(seconds[-1] / one)
        for k, figure in costs.drafter.items():
            figure.values.append(seconds[("pass", k)] / one)
    return costs


def _drafter_pass(
    m: MtpModel, prompt: list[int], fresh: Callable[[], Proposer], depths: Sequence[int]
) -> Callable[[int], None]:
    """One drafter pass of K drafts after the prompt (see the module's text); a depth the
    drafter cannot draft a round (past its block) is a one-line error."""
    proposer = fresh()  # taps the target's layers it reads
    cache = m.make_cache()
    proposer.begin(prompt, 0)
    _, hidden = m.forward(mx.array(prompt[:-1])[None], cache)
    proposer.observe(hidden, prompt[1:])
    proposer.end_prefill()
    greedy = SamplingSettings()
    first = proposer.propose(1, greedy)  # the prompt's features into the drafter's cache
    _, last = m.forward(mx.array(prompt[-1:])[None], cache)
    mx.eval(last, first.drafts if first is not None else [])

    def propose(k: int) -> Proposal | None:
        forked = proposer.fork()
        forked.observe(last, prompt[-1:])
        return forked.propose(k, greedy)

    for k in depths:
        proposal = propose(k)
        if proposal is None or proposal.depth != k:
            most = 0 if proposal is None else proposal.depth
            raise MtpkitError(
                f"--num-draft-tokens {k}: the {proposer.name} drafter proposes at most {most} "
                "tokens a round (its block): ask for fewer"
            )

    def step(k: int) -> None:
        proposal = propose(k)
        mx.eval(proposal.drafts if proposal is not None else [])

    return step


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
