"""`mtpkit bench`: plain decoding against MTP decoding at depths 1..K, in one run.

Plain decoding is stock `mlx_lm.stream_generate` on a separately loaded, untouched copy of
the same directory; `--no-mtp` is the same on mtpkit's load. Next to the realized speedups
it reports the two costs that bound them:

- beta: a 2-token verify forward (with mtpkit's gated-delta-net snapshots, as decoding runs
  it) over a 1-token forward;
- delta: one head step (projection, block, final norm, lm_head) over a 1-token forward;

and the ceiling (1 + a) / (beta + delta) at depth 1, generalised for depth K to
E_K / (beta_K + K delta), where E_K = 1 + a_1 + a_1 a_2 + ... is the expected number of
tokens per round from the per-depth acceptance and beta_K the (K+1)-token verify cost.

Every figure is the median of interleaved trials with its range (min-max): each trial runs
every configuration once, so a disturbance of the machine hits them all alike, and each
speedup is a ratio to stock decoding within the same trial. On a GPU one whole trial runs
untimed first (`warm_trial`): a shape met for the first time builds its kernels there, for
seconds (a verify whose rollback keeps a count not seen before, a key length not seen), and
a short warm-up meets only some of them. Every timed run starts after a collection and runs
with Python's collector off (`collector_off`): a collection inside a run (the decoder's
rounds make more objects than stock's loop, so more collections) timed the collector, not
the decoding. `prompt_tokens` sets the context: the prompt repeated to that
many tokens, or random ids for a random-weight model (`prompt_of_length`).
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.bench.oracle import OracleDrafts
from mtpkit.bench.prefilled import MtpState, Prefilled
from mtpkit.bench.report import (
    BenchResult,
    BenchRun,
    Costs,
    Figure,
    device_name,  # noqa: F401  (importable from here, as before the split)
    expected_tokens,
    print_bench,  # noqa: F401  (the CLI imports it from here)
)
from mtpkit.core.choices import MAX_DEPTH
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import (
    MtpModel,
    NoMtpHead,
    is_recurrent_cache,
    library_io,
    load_model,
    untapped,
)
from mtpkit.runtime.sharded import PIPELINE, load_sharded, world
from mtpkit.runtime.upcast import upcast_experts
from mtpkit.speculative.adaptive import AUTO_MAX_DEPTH
from mtpkit.speculative.decode import DraftFilter, MtpDecoder, SamplingSettings
from mtpkit.speculative.generate import check_prompt
from mtpkit.speculative.proposers import Proposer, default_proposer
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory

if TYPE_CHECKING:
    from mtpkit.bench.draft import DraftModelBench

DEFAULT_PROMPT = (
    "Write a short explanation of how a hash table works, with an example of inserting "
    "and looking up keys, and the cost of each operation."
)


class _ForwardTimer:
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
        for c, saved in zip(self.cache, self.saved, strict=True):
            if saved is None:
                c.trim(n)
            else:
                c.cache = list(saved)


def prompt_of_length(
    tokens: list[int], n: int, *, vocab: int | None = None, seed: int = 0
) -> list[int]:
    """A prompt of exactly `n` tokens: `tokens` (a real prompt's) repeated and cut, or with
    `vocab` synthetic, seeded random ids below it (a random-weight model's context)."""
    if n < 1:
        raise MtpkitError(f"--prompt-tokens must be at least 1, not {n}")
    if vocab is not None:
        draw = random.Random(seed)
        return [draw.randrange(vocab) for _ in range(n)]
    return (tokens * (n // len(tokens) + 1))[:n]


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """A timed run: after a full collection, with the collector off (no collection's pause
    inside the run; what it would free waits for the next run's start)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure_costs(m: MtpModel, prompt: list[int], *, max_depth: int, repeats: int = 20) -> Costs:
    """Interleaved per repeat: a 1-token forward, verifies of 2..K+1 tokens, a head step."""
    timer = _ForwardTimer(m, prompt)
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
    """One head step (block, final norm, lm_head, argmax) at the prompt's position."""
    head = m.head
    token = mx.array([[prompt[-1]]])
    dtype = m.embed(token).dtype
    h = mx.random.normal((1, 1, _hidden_size(m))).astype(dtype)
    cache = head.make_cache()
    warm = head(mx.repeat(h, len(prompt), axis=1), m.embed(mx.array(prompt)[None]), cache)
    mx.eval(warm)

    def step() -> None:
        x = head(h, m.embed(token), cache)
        logits = m.lm_head(head.final_norm(0)(x))
        mx.eval(mx.argmax(logits, axis=-1))
        for c in cache:
            c.trim(1)

    return step


def _hidden_size(m: MtpModel) -> int:
    text = m.config.get("text_config") or m.config
    return int(text["hidden_size"])


def _stock_run(
    model: nn.Module,
    tokenizer: Any,
    prompt: list[int],
    max_tokens: int,
    tick: Callable[[], None] = lambda: None,
    cache: list[Any] | None = None,
) -> float:
    """Decode tok/s of stock mlx-lm's `stream_generate` (its own `generation_tps`); `tick`
    after each token (the watchdog's beat across machines); `cache`: holding all but the
    prompt's last token (`Prefilled.stock_cache`), the only one left to feed."""
    import mlx_lm

    last = None
    fed = mx.array(prompt[-1:] if cache is not None else prompt)
    for response in mlx_lm.stream_generate(
        model, tokenizer, fed, max_tokens=max_tokens, prompt_cache=cache
    ):
        tick()
        last = response
    return float(last.generation_tps) if last is not None else 0.0


def _stock_tokens(model: nn.Module, tokenizer: Any, prompt: list[int], n: int) -> list[int]:
    """Stock mlx-lm's greedy continuation: what oracle drafts take as the backbone's tokens."""
    import mlx_lm

    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n)
    ]


def _mtp_run(
    m: MtpModel,
    prompt: list[int],
    depth: int,
    max_tokens: int,
    adaptive: bool = False,
    draft_filter: DraftFilter | None = None,
    pipeline: bool | str | None = None,
    proposer: Proposer | None = None,
    state: MtpState | None = None,
) -> tuple[float, float, MtpDecoder]:
    """Decode tok/s over rounds 2..end (the first round's tokens arrive with the prompt's
    cost, as the first token does in mlx-lm's figure), seconds per step (round or plain) over
    the same span, and the decoder with its stats. `pipeline` as `MtpDecoder` takes it;
    `proposer` drafts (default: the model's head); `state`: the prompt prefilled
    (`Prefilled.mtp_state`: caches, its proposer, tokens cached)."""
    cache, cached = None, 0
    if state is not None:
        cache, proposer, cached = state
    proposer = proposer or default_proposer(m)
    if isinstance(draft_filter, OracleDrafts):  # drafts and verdicts held to its plan
        proposer, draft_filter = draft_filter.proposer(proposer), None
    decoder = MtpDecoder(
        m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=adaptive,
        draft_filter=draft_filter, pipeline=pipeline, choose_depth=adaptive, proposer=proposer,
        cache=cache, cached=cached,
    )  # fmt: skip
    n = first_round = 0
    t0 = None
    for _ in decoder.tokens(max_tokens):
        n += 1
        steps = decoder.stats.rounds + decoder.stats.plain_steps
        if t0 is None:
            t0, first_steps = time.perf_counter(), steps
        if steps == first_steps:
            first_round += 1
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    tps = (n - first_round) / elapsed if n > first_round and elapsed > 0 else 0.0
    steps = decoder.stats.rounds + decoder.stats.plain_steps - first_steps if t0 else 0
    return tps, (elapsed / steps if steps > 0 else 0.0), decoder


def ceiling(
    acceptance_by_depth: list[float | None], verify_cost: float, delta: float
) -> float | None:
    """E_K / (beta_K + K delta): against a synchronous 1-token forward (a diagnostic)."""
    cost = verify_cost + len(acceptance_by_depth) * delta
    return expected_tokens(acceptance_by_depth) / cost if cost > 0 else None


def bench(
    model: str | Path,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 128,
    max_depth: int = 3,
    chat_template: bool = True,
    repeats: int = 20,
    trials: int = 5,
    acceptances: list[float] | None = None,
    seed: int = 0,
    draft: DraftModelBench | None = None,
    progress: Callable[[str], None] | None = None,
    pipeline: bool = False,
    drafters: Sequence[DrafterChoice] = (),
    num_draft_tokens: int = 3,
    prompt_tokens: int | None = None,
    synthetic: bool = False,
    warm_trial: bool | None = None,
) -> BenchResult:
    """Measure plain decoding against MTP decoding at depths 1..max_depth; `progress` gets a
    line per stage and per measured run. `acceptances`: instead of the head's own drafts,
    oracle drafts right with each of these probabilities (`mtpkit.bench.oracle`; synthetic).
    `draft`: also stock mlx-lm with a separate draft model (`mtpkit.bench.draft`);
    `drafters`: also mtpkit with these proposers (a draft model, prompt lookup): one more
    row each, in the same trials (without a head, only these rows; a draft model at
    `num_draft_tokens` a round, as stock's row).
    Under `mlx.launch` every rank measures its part in lockstep (`pipeline` as in
    `mtpkit.speculative.generate.generate`) against mlx-lm's own `sharded_load`, and every rank
    returns the same runs (the timings are each rank's own: rank 0's are the ones to print).
    `prompt_tokens`: the prompt made that long (`prompt_of_length`; `synthetic`: random ids)."""
    if trials < 1 or max_tokens < 1:
        raise MtpkitError(f"trials and max_tokens must be at least 1, not {trials}, {max_tokens}")
    if acceptances is not None and not all(0.0 <= a <= 1.0 for a in acceptances):
        raise MtpkitError(f"--acceptance takes values in [0, 1], not {acceptances}")
    say = progress or (lambda s: None)
    group = world()
    m = load_model(model) if group is None else load_sharded(model, group, pipeline=pipeline)
    if not m.has_head and not drafters:
        raise NoMtpHead(
            f"{m.path} has no MTP head: run `mtpkit inspect` and `mtpkit convert`, or bench "
            "another drafter (--draft-model, --prompt-lookup)"
        )
    eos = m.tokenizer.eos_token_ids
    m.tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    try:
        tokens = encode_prompt(m.tokenizer, prompt, chat_template=chat_template)
        if prompt_tokens is not None:
            vocab = int(m.embedding.weight.shape[0]) if synthetic else None
            tokens = prompt_of_length(tokens, prompt_tokens, vocab=vocab, seed=seed)
        check_prompt(m, tokens)
        say("forward and head costs")
        costs = measure_costs(m, tokens, max_depth=max_depth, repeats=repeats)
        factories = {f.name: f for f in (ProposerFactory(m, c) for c in drafters)}
        rows = [
            (name, min(num_draft_tokens, MAX_DEPTH), False)
            if name in ("draft-model", "gemma4-assistant")
            else (name, AUTO_MAX_DEPTH, True)
            for name in factories
        ]
        plan = Plan(max_tokens, max_depth, trials, acceptances, seed, rows, m.has_head)
        plan.warm_trial = device_name() == "gpu" if warm_trial is None else warm_trial
        return _trials(m, str(model), tokens, costs, plan, say, draft, factories)
    finally:
        m.tokenizer.eos_token_ids = eos


# (depth, adaptive, oracle acceptance or None, proposer): one MTP run of each trial.
Config = tuple[int, bool, float | None, str]


@dataclass
class Plan:
    max_tokens: int
    max_depth: int
    trials: int
    acceptances: list[float] | None
    seed: int
    # Proposers besides the head: (name, depth, adaptive) of each one's row.
    drafters: list[tuple[str, int, bool]] = field(default_factory=list)
    head: bool = True
    # One whole trial untimed before the counted ones (bench's default on a GPU).
    warm_trial: bool = False

    def configs(self) -> list[Config]:
        """The MTP runs each trial makes after stock and --no-mtp: depths 1..K and adaptive
        drafting as `generate --mtp` runs it by default (each round's depth chosen, 1 to
        AUTO_MAX_DEPTH), with the head's drafts or at each oracle acceptance; then each other
        proposer at its depth: a draft model's fixed, as stock's row drafts, prompt lookup's
        chosen adaptively (generate's default)."""
        out: list[Config] = []
        for a in (
            (self.acceptances if self.acceptances is not None else [None]) if self.head else []
        ):
            out += [(d, False, a, "mtp") for d in range(1, self.max_depth + 1)]
            out.append((AUTO_MAX_DEPTH, True, a, "mtp"))
        out += [(depth, adaptive, None, name) for name, depth, adaptive in self.drafters]
        return out


def _name(config: Config) -> str:
    depth, adaptive, oracle, drafter = config
    name = f"MTP depth 1-{depth} adaptive" if adaptive else f"MTP depth {depth}"
    if drafter != "mtp":
        name = f"{drafter} {name.removeprefix('MTP ')}"
    return name if oracle is None else f"{name} at oracle acceptance {oracle:g}"


def _trials(
    m: MtpModel,
    model: str,
    tokens: list[int],
    costs: Costs,
    plan: Plan,
    say: Callable[[str], None],
    draft: DraftModelBench | None = None,
    factories: dict[str, ProposerFactory] | None = None,
) -> BenchResult:
    factories = factories or {}
    prefilled = Prefilled(m, tokens)  # every run continues from the prompt prefilled once

    def start(name: str) -> dict[str, Any]:  # a run's prefilled state, else its proposer
        fresh = factories.get(name) or (lambda: default_proposer(m))
        forked = prefilled.mtp_state(name, fresh)
        return {"state": forked} if forked is not None else {"proposer": fresh()}

    # Stock mlx-lm on its own, untouched load of the directory.
    stock_model, stock_tokenizer = _stock_load(m)
    upcast_experts([stock_model], what=str(m.path))  # as mtpkit's own load does (CPU only)
    stock_tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    _stock_run(stock_model, stock_tokenizer, tokens, 8, cache=prefilled.stock_cache(stock_model))
    for depth in range(1, max(plan.max_depth, AUTO_MAX_DEPTH) + 1):  # kernel builds, routes
        for name in ["mtp"] * plan.head + list(factories):
            _mtp_run(m, tokens, depth, 8, **start(name))
    if plan.head:  # and adaptive drafting's path
        _mtp_run(m, tokens, AUTO_MAX_DEPTH, 8, adaptive=True, **start("mtp"))
    if draft is not None:
        draft.check_target(stock_model, stock_tokenizer)
        draft.run(stock_model, stock_tokenizer, tokens, 8)  # warm up
    filters: dict[float | None, DraftFilter | None] = {None: None}
    if plan.acceptances is not None:
        reference = _stock_tokens(stock_model, stock_tokenizer, tokens, plan.max_tokens + 8)
        vocab = int(m.embedding.weight.shape[0])
        for a in plan.acceptances:
            filters[a] = OracleDrafts(reference, len(tokens), a, vocab, plan.seed)
    for trial in range(-1 if plan.warm_trial else 0, plan.trials):
        at = f"trial {trial + 1}/{plan.trials}:" if trial >= 0 else "untimed trial:"
        if trial <= 0:  # the untimed trial's figures are dropped
            plain, no_mtp, no_mtp_speedup = Figure(), Figure(), Figure()
            runs = {
                c: BenchRun(c[0], c[1], [], [], Figure(), Figure(), Figure(), oracle=c[2],
                            drafter=c[3])
                for c in plan.configs()
            }  # fmt: skip
        with collector_off():
            cache = prefilled.stock_cache(stock_model)
            base = _stock_run(
                stock_model, stock_tokenizer, tokens, plan.max_tokens, m.lockstep.tick, cache
            )
        say(f"{at} stock mlx-lm {base:.1f} tok/s")
        plain.values.append(base)
        cache = prefilled.stock_cache(m.model)
        with untapped(m.final_norm), collector_off():
            rate = _stock_run(m.model, m.tokenizer, tokens, plan.max_tokens, m.lockstep.tick, cache)
            no_mtp.values.append(rate)
        say(f"{at} mtpkit --no-mtp {no_mtp.values[-1]:.1f} tok/s")
        no_mtp_speedup.values.append(no_mtp.values[-1] / base if base else 0.0)
        if draft is not None and not draft.result.unavailable:
            rate = draft.run(
                stock_model, stock_tokenizer, tokens, plan.max_tokens, base if trial >= 0 else None
            )
            share = draft.result.acceptance
            say(f"{at} draft model {rate:.1f} tok/s"
                + (f", {share:.1%} from the draft" if share is not None else ""))  # fmt: skip
        for config, run in runs.items():
            depth, adaptive, oracle, drafter = config
            begin = start(drafter)
            with collector_off():
                rate, step, decoder = _mtp_run(
                    m, tokens, depth, plan.max_tokens, adaptive, filters[oracle], **begin
                )
            _record(run, decoder, rate, base, step)
            accepted = run.acceptances[-1]
            shown = "n/a" if accepted is None else f"{accepted:.1%}"
            say(f"{at} {_name(config)} {rate:.1f} tok/s, acceptance {shown}")
    del stock_model
    for run in runs.values():
        # The ceiling counts head steps (delta): the head's fixed-depth rows only.
        if not run.adaptive and run.drafter == "mtp" and run.depth in costs.verify:
            verify = costs.verify[run.depth].median
            run.ceiling_sync = ceiling(run.acceptance_by_depth, verify, costs.delta.median)
    return BenchResult(
        model, plain, no_mtp, costs, list(runs.values()), len(tokens), plan.max_tokens,
        plan.trials, no_mtp_speedup, moe_dtype=m.moe_dtype, acceptances=plan.acceptances,
        draft_model=draft.result if draft is not None else None,
    )  # fmt: skip


def _stock_load(m: MtpModel) -> tuple[nn.Module, Any]:
    """Stock mlx-lm's own load of the directory: `mlx_lm.load`, or across ranks its
    `sharded_load` sharded the same way as mtpkit's model."""
    import mlx_lm
    from mlx_lm.utils import sharded_load

    lockstep = m.lockstep
    with library_io():  # never remote code, never a question on stdin
        if lockstep.size == 1:
            return mlx_lm.load(str(m.path), tokenizer_config={"trust_remote_code": False})
        pipeline = lockstep.sharding == PIPELINE
        try:
            return sharded_load(
                str(m.path),
                pipeline_group=lockstep.group if pipeline else None,
                tensor_group=None if pipeline else lockstep.group,
                tokenizer_config={"trust_remote_code": False},
            )
        except ValueError as e:
            raise MtpkitError(
                f"mlx-lm's sharded_load, bench's baseline, cannot load {m.path} that way "
                f"({e}): drop --pipeline"
            ) from None


def _record(run: BenchRun, decoder: MtpDecoder, rate: float, base: float, step: float) -> None:
    stats = decoder.stats
    run.decode_tps.values.append(rate)
    run.speedup.values.append(rate / base if base else 0.0)
    run.step_seconds.values.append(step)
    run.acceptances.append(stats.acceptance)
    run.by_depth.append(stats.acceptance_by_depth(run.depth))
    run.rounds.append(stats.rounds)
    run.plain_steps.append(stats.plain_steps)
    run.rounds_by_depth.append(stats.rounds_by_depth[: run.depth])
