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
speedup is a ratio to stock decoding within the same trial: stock runs at the trial's start,
after every few runs and at its end, and each run is compared with stock's rate interpolated
to its time (`anchors.Anchored`). On a GPU one whole trial runs
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

from mtpkit.bench.anchors import Anchored
from mtpkit.bench.costs import measure_costs
from mtpkit.bench.plan import BLOCK_DRAFTERS, Config, Plan, config_name, drafter_rows
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
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import (
    MtpModel,
    NoMtpHead,
    library_io,
    load_model,
    untapped,
)
from mtpkit.runtime.sharded import PIPELINE, load_sharded, world
from mtpkit.runtime.upcast import upcast_experts
from mtpkit.speculative.adaptive import AUTO_MAX_DEPTH
from mtpkit.speculative.decode import DraftFilter, MtpDecoder, SamplingSettings
from mtpkit.speculative.generate import check_prompt
from mtpkit.speculative.oracle import OracleDrafts
from mtpkit.speculative.proposers import Proposer, default_proposer
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.stats import Stats

if TYPE_CHECKING:
    from mtpkit.bench.draft import DraftModelBench

DEFAULT_PROMPT = (
    "Write a short explanation of how a hash table works, with an example of inserting "
    "and looking up keys, and the cost of each operation."
)


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


def stock_run(
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


def stock_tokens(model: nn.Module, tokenizer: Any, prompt: list[int], n: int) -> list[int]:
    """Stock mlx-lm's greedy continuation: what oracle drafts take as the backbone's tokens."""
    import mlx_lm

    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n)
    ]


def mtp_run(
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
    block_depths: Sequence[int] = (),
    prompt_tokens: int | None = None,
    synthetic: bool = False,
    warm_trial: bool | None = None,
) -> BenchResult:
    """Measure plain decoding against MTP decoding at depths 1..max_depth; `progress` gets a
    line per stage and per measured run. `acceptances`: instead of the head's own drafts,
    oracle drafts right with each of these probabilities (`mtpkit.speculative.oracle`; synthetic).
    `draft`: also stock mlx-lm with a separate draft model (`mtpkit.bench.draft`);
    `drafters`: also mtpkit with these proposers (a draft model, prompt lookup): one more
    row each, in the same trials (without a head, only these rows; a draft model at
    `num_draft_tokens` a round, as stock's row; a block drafter also at each of
    `block_depths`, with its pass's cost over a 1-token forward, `mtpkit.bench.plan`).
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
        factories = {f.name: f for f in (ProposerFactory(m, c) for c in drafters)}
        rows = drafter_rows(factories, num_draft_tokens, block_depths)
        plan = Plan(max_tokens, max_depth, trials, acceptances, seed, rows, m.has_head)
        plan.warm_trial = device_name() == "gpu" if warm_trial is None else warm_trial
        block = next((f for name, f in factories.items() if name in BLOCK_DRAFTERS), None)
        if block_depths and block is None:
            raise MtpkitError(
                "block depths are a block drafter's rows: bench one (DFlash, EAGLE-3)"
            )
        say("forward and head costs" if block is None else "forward and drafter costs")
        costs = measure_costs(m, tokens, max_depth=max_depth, repeats=repeats, drafter=block,
                              drafter_depths=block_depths if block is not None else ())  # fmt: skip
        return _trials(m, str(model), tokens, costs, plan, say, draft, factories)
    finally:
        m.tokenizer.eos_token_ids = eos


@dataclass
class _Setup:
    """What every trial runs with: the model, its prompt prefilled once, stock's own load."""

    m: MtpModel
    tokens: list[int]
    plan: Plan
    say: Callable[[str], None]
    prefilled: Prefilled
    stock_model: nn.Module
    stock_tokenizer: Any
    factories: dict[str, ProposerFactory]
    draft: DraftModelBench | None
    filters: dict[float | None, DraftFilter | None] = field(default_factory=dict)

    def start(self, name: str) -> dict[str, Any]:
        """A run's prefilled state, else its fresh proposer."""
        fresh = self.factories.get(name) or (lambda: default_proposer(self.m))
        forked = self.prefilled.mtp_state(name, fresh)
        return {"state": forked} if forked is not None else {"proposer": fresh()}

    def stock(self, max_tokens: int) -> float:
        cache = self.prefilled.stock_cache(self.stock_model)
        return stock_run(
            self.stock_model, self.stock_tokenizer, self.tokens, max_tokens, self.m.lockstep.tick,
            cache,
        )  # fmt: skip


@dataclass
class _Figures:
    """A bench's figures, trial by trial."""

    runs: dict[Config, BenchRun]
    plain: Figure = field(default_factory=Figure)
    no_mtp: Figure = field(default_factory=Figure)
    no_mtp_speedup: Figure = field(default_factory=Figure)
    stock_self: Figure = field(default_factory=Figure)  # stock over itself (`self_ratios`)


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
    # Stock mlx-lm on its own, untouched load of the directory.
    stock_model, stock_tokenizer = stock_load(m)
    upcast_experts([stock_model], what=str(m.path))  # as mtpkit's own load does (CPU only)
    stock_tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    # Every run continues from the prompt prefilled once.
    setup = _Setup(m, tokens, plan, say, Prefilled(m, tokens), stock_model, stock_tokenizer,
                   factories or {}, draft)  # fmt: skip
    setup.stock(8)  # warm up
    for depth in range(1, max(plan.max_depth, AUTO_MAX_DEPTH) + 1):  # kernel builds, routes
        for name in ["mtp"] * plan.head + list(setup.factories):
            mtp_run(m, tokens, depth, 8, **setup.start(name))
    for name, depth, adaptive in plan.drafters:  # a block drafter's deeper rows
        if not adaptive and depth > max(plan.max_depth, AUTO_MAX_DEPTH):
            mtp_run(m, tokens, depth, 8, **setup.start(name))
    if plan.head:  # and adaptive drafting's path
        mtp_run(m, tokens, AUTO_MAX_DEPTH, 8, adaptive=True, **setup.start("mtp"))
    if draft is not None:
        draft.check_target(stock_model, stock_tokenizer)
        draft.run(stock_model, stock_tokenizer, tokens, 8)  # warm up
    setup.filters[None] = None
    if plan.acceptances is not None:
        # Past the last output token too: a round's block may reach that far.
        reference = stock_tokens(stock_model, stock_tokenizer, tokens,
                                 plan.max_tokens + max(8, plan.deepest + 1))  # fmt: skip
        vocab = int(m.embedding.weight.shape[0])
        for a in plan.acceptances:
            setup.filters[a] = OracleDrafts(reference, len(tokens), a, vocab, plan.seed)
    for trial in range(-1 if plan.warm_trial else 0, plan.trials):
        if trial <= 0:  # the untimed trial's figures are dropped
            figures = _Figures({
                c: BenchRun(c[0], c[1], [], [], Figure(), Figure(), Figure(), oracle=c[2],
                            drafter=c[3])
                for c in plan.configs()
            })  # fmt: skip
        _one_trial(setup, trial, figures)
    del stock_model, setup
    for run in figures.runs.values():
        # The ceiling counts head steps (delta) or one drafter pass: fixed-depth rows only.
        if run.adaptive or run.depth not in costs.verify:
            continue
        verify = costs.verify[run.depth].median
        if run.drafter == "mtp":
            run.ceiling_sync = ceiling(run.acceptance_by_depth, verify, costs.delta.median)
        elif run.depth in costs.drafter:
            run.round_cost = verify + costs.drafter[run.depth].median
            run.ceiling_sync = ceiling(run.acceptance_by_depth, run.round_cost, 0.0)
    return BenchResult(
        model, figures.plain, figures.no_mtp, costs, list(figures.runs.values()), len(tokens),
        plan.max_tokens, plan.trials, figures.no_mtp_speedup, stock_self=figures.stock_self,
        moe_dtype=m.moe_dtype,
        draft_vocab=m.drafting.size,
        acceptances=plan.acceptances, draft_model=draft.result if draft is not None else None,
    )  # fmt: skip


DRAFT_ROW = "draft model (stock mlx-lm)"  # the timed run of stock mlx-lm's draft-model row


def _one_trial(setup: _Setup, trial: int, figures: _Figures) -> None:
    """Stock (at the start, after every few runs and at the end: `anchors.Anchored`),
    `--no-mtp`, a draft model's stock row, then each configuration; each run's speedup is
    over stock's rate interpolated to its time."""
    m, tokens, plan, say, draft = setup.m, setup.tokens, setup.plan, setup.say, setup.draft
    at = f"trial {trial + 1}/{plan.trials}:" if trial >= 0 else "untimed trial:"

    def stock() -> float:
        with collector_off():
            rate = setup.stock(plan.max_tokens)
        say(f"{at} stock mlx-lm {rate:.1f} tok/s")
        return rate

    def mtp(config: Config) -> tuple[Config, float, float, Stats]:
        depth, adaptive, oracle, drafter = config
        begin = setup.start(drafter)
        with collector_off():
            rate, step, decoder = mtp_run(
                m, tokens, depth, plan.max_tokens, adaptive, setup.filters[oracle], **begin
            )
        return config, rate, step, decoder.stats

    trial_runs: Anchored[tuple[Config | str | None, float, float, Stats | None]]
    trial_runs = Anchored(stock)
    trial_runs.anchor()
    _, rate, _, _ = trial_runs.timed(
        lambda: (None, _no_mtp_run(m, tokens, plan, setup.prefilled), 0.0, None)
    )
    say(f"{at} mtpkit --no-mtp {rate:.1f} tok/s")
    if draft is not None and not draft.result.unavailable:
        # Timed as every other row, so that its speedup is over stock's rate at its time.
        def draft_run() -> float:
            return draft.run(setup.stock_model, setup.stock_tokenizer, tokens, plan.max_tokens)

        if trial < 0:
            rate = draft_run()
        else:
            _, rate, _, _ = trial_runs.timed(lambda: (DRAFT_ROW, draft_run(), 0.0, None))
        share = draft.result.acceptance
        say(f"{at} draft model {rate:.1f} tok/s"
            + (f", {share:.1%} from the draft" if share is not None else ""))  # fmt: skip
    for config in figures.runs:
        _, rate, _, stats = trial_runs.timed(lambda c=config: mtp(c))
        shown = "n/a" if stats is None or stats.acceptance is None else f"{stats.acceptance:.1%}"
        say(f"{at} {config_name(config)} {rate:.1f} tok/s, acceptance {shown}")
    for (config, rate, step, stats), baseline in trial_runs.finish():
        if config == DRAFT_ROW and draft is not None:
            draft.record(rate, baseline)
        elif config is None or stats is None:
            figures.no_mtp.values.append(rate)
            figures.no_mtp_speedup.values.append(rate / baseline if baseline else 0.0)
        else:
            _record(figures.runs[config], stats, rate, baseline, step)
    figures.plain.values.extend(trial_runs.stock_rates)
    figures.stock_self.values.extend(trial_runs.self_ratios())


def stock_load(m: MtpModel) -> tuple[nn.Module, Any]:
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


def _no_mtp_run(m: MtpModel, tokens: list[int], plan: Plan, prefilled: Prefilled) -> float:
    """`--no-mtp`: stock mlx-lm's loop on mtpkit's load (its final norm untapped)."""
    cache = prefilled.stock_cache(m.model)
    with untapped(m.final_norm), collector_off():
        return stock_run(m.model, m.tokenizer, tokens, plan.max_tokens, m.lockstep.tick, cache)


def _record(run: BenchRun, stats: Stats, rate: float, base: float, step: float) -> None:
    run.decode_tps.values.append(rate)
    run.speedup.values.append(rate / base if base else 0.0)
    run.step_seconds.values.append(step)
    run.acceptances.append(stats.acceptance)
    run.by_depth.append(stats.acceptance_by_depth(run.depth))
    run.rounds.append(stats.rounds)
    run.plain_steps.append(stats.plain_steps)
    run.rounds_by_depth.append(stats.rounds_by_depth[: run.depth])
    run.looked_ahead.append((stats.pipelined, stats.launched_ahead, stats.discarded))
