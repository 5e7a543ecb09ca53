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
speedup is a ratio to stock decoding within the same trial.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import (
    MtpModel,
    NoMtpHead,
    is_recurrent_cache,
    library_io,
    load_model,
    untapped,
)
from mtpkit.runtime.upcast import upcast_experts
from mtpkit.spec.decode import MtpDecoder, SamplingSettings
from mtpkit.spec.generate import check_prompt, encode_prompt

DEFAULT_PROMPT = (
    "Write a short explanation of how a hash table works, with an example of inserting "
    "and looking up keys, and the cost of each operation."
)


@dataclass
class Figure:
    """Repeated measurements of one quantity: the median and the range."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0

    @property
    def range(self) -> list[float]:
        return [min(self.values), max(self.values)] if self.values else [0.0, 0.0]

    def __str__(self) -> str:
        low, high = self.range
        return f"{self.median:.3g} [{low:.3g}-{high:.3g}]"


@dataclass
class BenchRun:
    depth: int
    adaptive: bool
    acceptance: float | None
    acceptance_by_depth: list[float | None]
    decode_tps: Figure
    speedup: Figure  # decode tok/s over stock's in the same trial
    ceiling: float | None
    plain_steps: int = 0
    rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "depth": self.depth,
            "adaptive": self.adaptive,
            "acceptance": self.acceptance,
            "acceptance_by_depth": self.acceptance_by_depth,
            "decode_tps": self.decode_tps.median,
            "decode_tps_range": self.decode_tps.range,
            "speedup": self.speedup.median,
            "speedup_range": self.speedup.range,
            "ceiling": self.ceiling,
            "realized_over_ceiling": (self.speedup.median / self.ceiling)
            if self.ceiling
            else None,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
        }


@dataclass
class Costs:
    """Per repeat, interleaved: a 1-token forward's seconds, the (K+1)-token verify over it,
    and a head step over it."""

    one: Figure = field(default_factory=Figure)
    verify: dict[int, Figure] = field(default_factory=dict)
    delta: Figure = field(default_factory=Figure)


@dataclass
class BenchResult:
    model: str
    plain_tps: Figure
    no_mtp_tps: Figure
    costs: Costs
    runs: list[BenchRun]
    prompt_tokens: int
    max_tokens: int
    trials: int
    no_mtp_speedup: Figure = field(default_factory=Figure)
    dtype: str | None = None
    moe_dtype: str | None = None  # what the experts ran in (bf16 experts run in float32 on CPU)

    @property
    def beta(self) -> Figure:
        return self.costs.verify[1]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": device_name(),
            "mlx": mx.__version__,
            "dtype": self.dtype,
            "moe_dtype": self.moe_dtype,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "trials": self.trials,
            "plain_tps": self.plain_tps.median,
            "plain_tps_range": self.plain_tps.range,
            "no_mtp_tps": self.no_mtp_tps.median,
            "no_mtp_tps_range": self.no_mtp_tps.range,
            "no_mtp_speedup": self.no_mtp_speedup.median,
            "forward_seconds": self.costs.one.median,
            "beta": self.beta.median,
            "beta_range": self.beta.range,
            "delta": self.costs.delta.median,
            "delta_range": self.costs.delta.range,
            "verify_costs": {str(k + 1): v.median for k, v in self.costs.verify.items()},
            "runs": [r.to_json() for r in self.runs if not r.adaptive],
            "adaptive": [r.to_json() for r in self.runs if r.adaptive],
        }


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


def _stock_run(model: nn.Module, tokenizer: Any, prompt: list[int], max_tokens: int) -> float:
    """Decode tok/s of stock mlx-lm's `stream_generate` (its own `generation_tps`)."""
    import mlx_lm

    last = None
    for response in mlx_lm.stream_generate(
        model, tokenizer, mx.array(prompt), max_tokens=max_tokens
    ):
        last = response
    return float(last.generation_tps) if last is not None else 0.0


def _mtp_run(
    m: MtpModel, prompt: list[int], depth: int, max_tokens: int, adaptive: bool = False
) -> tuple[float, MtpDecoder]:
    """Decode tok/s over rounds 2..end (the first round's tokens arrive with the prompt's
    cost, as the first token does in mlx-lm's figure), and the decoder with its stats."""
    decoder = MtpDecoder(m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=adaptive)
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
    return tps, decoder


def ceiling(
    acceptance_by_depth: list[float | None], verify_cost: float, delta: float
) -> float | None:
    expected = 1.0
    running = 1.0
    for a in acceptance_by_depth:
        running *= a or 0.0
        expected += running
    cost = verify_cost + len(acceptance_by_depth) * delta
    return expected / cost if cost > 0 else None


def device_name() -> str:
    """MLX's default device as a plain word ("cpu", "gpu"), not the repr `Device(cpu, 0)`."""
    return mx.default_device().type.name


def bench(
    model: str | Path,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 128,
    max_depth: int = 3,
    chat_template: bool = True,
    repeats: int = 20,
    trials: int = 5,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure plain decoding against MTP decoding at depths 1..max_depth; `progress` gets a
    line per stage and per measured run."""
    if trials < 1 or max_tokens < 1:
        raise MtpkitError(f"trials and max_tokens must be at least 1, not {trials}, {max_tokens}")
    say = progress or (lambda s: None)
    m = load_model(model)
    if m.head is None:
        raise NoMtpHead(f"{m.path} has no MTP head: run `mtpkit inspect` and `mtpkit convert`")
    eos = m.tokenizer.eos_token_ids
    m.tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    try:
        tokens = encode_prompt(m, prompt, chat_template=chat_template)
        check_prompt(m, tokens)
        say("forward and head costs")
        costs = measure_costs(m, tokens, max_depth=max_depth, repeats=repeats)
        return _trials(m, str(model), tokens, costs, max_tokens, max_depth, trials, say)
    finally:
        m.tokenizer.eos_token_ids = eos


def _configs(max_depth: int) -> list[tuple[int, bool]]:
    """(depth, adaptive) of the MTP runs each trial makes after stock and --no-mtp."""
    return [(d, False) for d in range(1, max_depth + 1)] + [(1, True)]


def _trials(
    m: MtpModel,
    model: str,
    tokens: list[int],
    costs: Costs,
    max_tokens: int,
    max_depth: int,
    trials: int,
    say: Callable[[str], None],
) -> BenchResult:
    import mlx_lm

    # Stock mlx-lm on its own, untouched load of the directory.
    with library_io():  # never remote code, never a question on stdin
        stock_model, stock_tokenizer = mlx_lm.load(
            str(m.path), tokenizer_config={"trust_remote_code": False}
        )
    upcast_experts([stock_model], what=str(m.path))  # as mtpkit's own load does (CPU only)
    stock_tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    _stock_run(stock_model, stock_tokenizer, tokens, 8)  # warm up
    _mtp_run(m, tokens, 1, 8)
    plain, no_mtp, no_mtp_speedup = Figure(), Figure(), Figure()
    tps = {c: Figure() for c in _configs(max_depth)}
    speedup = {c: Figure() for c in _configs(max_depth)}
    last: dict[tuple[int, bool], MtpDecoder] = {}
    for trial in range(trials):
        at = f"trial {trial + 1}/{trials}:"
        base = _stock_run(stock_model, stock_tokenizer, tokens, max_tokens)
        say(f"{at} stock mlx-lm {base:.1f} tok/s")
        plain.values.append(base)
        with untapped(m.final_norm):
            no_mtp.values.append(_stock_run(m.model, m.tokenizer, tokens, max_tokens))
        say(f"{at} mtpkit --no-mtp {no_mtp.values[-1]:.1f} tok/s")
        no_mtp_speedup.values.append(no_mtp.values[-1] / base if base else 0.0)
        for config in _configs(max_depth):
            rate, last[config] = _mtp_run(m, tokens, config[0], max_tokens, adaptive=config[1])
            tps[config].values.append(rate)
            speedup[config].values.append(rate / base if base else 0.0)
            acceptance = last[config].stats.acceptance
            accepted = "n/a" if acceptance is None else f"{acceptance:.1%}"
            name = f"MTP depth {config[0]}" + (" adaptive" if config[1] else "")
            say(f"{at} {name} {rate:.1f} tok/s, acceptance {accepted}")
    del stock_model
    runs = []
    for depth, adaptive in _configs(max_depth):
        stats = last[(depth, adaptive)].stats
        by_depth = stats.acceptance_by_depth(depth)
        runs.append(
            BenchRun(
                depth=depth,
                adaptive=adaptive,
                acceptance=stats.acceptance,
                acceptance_by_depth=by_depth,
                decode_tps=tps[(depth, adaptive)],
                speedup=speedup[(depth, adaptive)],
                ceiling=None
                if adaptive
                else ceiling(by_depth, costs.verify[depth].median, costs.delta.median),
                plain_steps=stats.plain_steps,
                rounds=stats.rounds,
            )
        )
    return BenchResult(
        model, plain, no_mtp, costs, runs, len(tokens), max_tokens, trials, no_mtp_speedup,
        moe_dtype=m.moe_dtype,
    )  # fmt: skip


def print_bench(result: BenchResult) -> None:
    """The table people read (stdout)."""
    from rich.table import Table

    from mtpkit.core.console import stdout

    costs = result.costs
    stdout.print(
        f"[bold]{result.model}[/bold] on {device_name()}: prompt {result.prompt_tokens} "
        f"tokens, {result.max_tokens} generated per run, median \\[min-max] of "
        f"{result.trials} interleaved trials"
        + (f", experts in {result.moe_dtype}" if result.moe_dtype else "")
    )
    verify = ", ".join(f"{k + 1} tokens {v}" for k, v in sorted(costs.verify.items()))
    stdout.print(
        f"1-token forward {costs.one.median * 1e3:.2f} ms; beta {result.beta}, delta "
        f"{costs.delta}, beta+delta {result.beta.median + costs.delta.median:.3f} "
        f"(verify over a 1-token forward: {verify})"
    )
    table = Table(title_justify="left")
    for col in ("decoding", "tok/s", "vs stock", "acceptance", "by depth", "ceiling", "of ceiling"):
        table.add_column(col, justify="left" if col in ("decoding", "by depth") else "right")
    table.add_row("stock mlx-lm", str(result.plain_tps), "1", "", "", "", "")
    table.add_row("--no-mtp", str(result.no_mtp_tps), str(result.no_mtp_speedup), *[""] * 4)
    for r in result.runs:
        by_depth = " ".join("-" if a is None else f"{a:.0%}" for a in r.acceptance_by_depth)
        name = f"depth {r.depth}" + (", adaptive" if r.adaptive else "")
        table.add_row(
            name,
            str(r.decode_tps),
            str(r.speedup),
            "-" if r.acceptance is None else f"{r.acceptance:.1%}",
            by_depth,
            "-" if r.ceiling is None else f"{r.ceiling:.2f}",
            "-" if not r.ceiling else f"{r.speedup.median / r.ceiling:.0%}",
        )
    stdout.print(table)
