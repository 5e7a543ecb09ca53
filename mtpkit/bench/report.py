"""`mtpkit bench`'s figures: medians with ranges, the JSON, the table, and whether the
trials say anything (`reliability`).

Costs are given two ways. Against the pipelined baseline (what the speedups are ratios to):
stock mlx-lm's seconds per token in its own loop (`stock_token_ms`, from its decode rate) and
each run's seconds per step (`step_ms`: per round, or per plain step); the ceiling
`ceiling_pipelined` = E_K * stock_token / step, E_K = 1 + a_1 + a_1 a_2 + ... the tokens a
round yields, and `of_ceiling` the speedup over it. Against a synchronous forward
(diagnostics, as before): beta (a 2-token verify over a 1-token forward), delta (a head step
over it) and `ceiling` = E_K / (beta_K + K delta). A block drafter's fixed-depth rows
instead carry `round_cost`: the verify of K+1 tokens plus one drafter pass of K, over a
1-token forward (`drafter_costs` the passes alone), and `ceiling` = E_K / round_cost.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mtpkit.runtime.kernels.routing import routes_summary
from mtpkit.speculative.adaptive import expected_tokens

MIN_TRIALS = 5
MAX_SPREAD = 0.25  # (max - min) / median of a speedup beyond which it means little


def device_name() -> str:
    """MLX's default device as a plain word ("cpu", "gpu"), not the repr `Device(cpu, 0)`."""
    return mx.default_device().type.name


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

    @property
    def spread(self) -> float:
        low, high = self.range
        return (high - low) / self.median if self.median else 0.0

    def __str__(self) -> str:
        low, high = self.range
        return f"{self.median:.3g} [{low:.3g}-{high:.3g}]"


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class BenchRun:
    depth: int
    adaptive: bool
    # Per trial (medians reported): overall and per-depth acceptance, rounds, plain steps.
    acceptances: list[float | None]
    by_depth: list[list[float | None]]
    decode_tps: Figure
    speedup: Figure  # decode tok/s over stock's in the same trial
    step_seconds: Figure  # seconds per round or plain step after the first
    ceiling_sync: float | None = None
    rounds: list[int] = field(default_factory=list)
    plain_steps: list[int] = field(default_factory=list)
    rounds_by_depth: list[list[int]] = field(default_factory=list)  # adaptive's choices
    # Rounds looked ahead, launched ahead, discarded (`speculative/look_ahead.py`'s choices).
    looked_ahead: list[tuple[int, int, int]] = field(default_factory=list)
    oracle: float | None = None  # synthetic: drafts right with this probability
    drafter: str = "mtp"  # the proposer: the head, "draft-model", "gemma4-assistant", ...
    # A block drafter's round (verify of depth+1 and one pass) over a 1-token forward.
    round_cost: float | None = None

    @property
    def acceptance(self) -> float | None:
        return _median_or_none(self.acceptances)

    @property
    def acceptance_by_depth(self) -> list[float | None]:
        return [_median_or_none([t[j] for t in self.by_depth]) for j in range(self.depth)]

    def ceiling_pipelined(self, stock_token: float) -> float | None:
        if self.adaptive or not self.step_seconds.median:
            return None
        return expected_tokens(self.acceptance_by_depth) * stock_token / self.step_seconds.median

    def to_json(self, stock_token: float) -> dict[str, Any]:
        ceiling = self.ceiling_pipelined(stock_token)
        return {
            "depth": self.depth,
            "adaptive": self.adaptive,
            "drafter": self.drafter,
            "synthetic_acceptance": self.oracle,
            "acceptance": self.acceptance,
            "acceptance_by_depth": self.acceptance_by_depth,
            "decode_tps": self.decode_tps.median,
            "decode_tps_range": self.decode_tps.range,
            "speedup": self.speedup.median,
            "speedup_range": self.speedup.range,
            "step_ms": self.step_seconds.median * 1e3,
            "ceiling_pipelined": ceiling,
            "of_ceiling": self.speedup.median / ceiling if ceiling else None,
            "ceiling": self.ceiling_sync,
            "round_cost": self.round_cost,
            "realized_over_ceiling": (self.speedup.median / self.ceiling_sync)
            if self.ceiling_sync
            else None,
            "rounds": statistics.median(self.rounds) if self.rounds else 0,
            "plain_steps": statistics.median(self.plain_steps) if self.plain_steps else 0,
            "rounds_by_depth": [
                statistics.median(t[j] for t in self.rounds_by_depth) for j in range(self.depth)
            ] if self.rounds_by_depth else [],
            **{
                key: statistics.median(t[j] for t in self.looked_ahead) if self.looked_ahead else 0
                for j, key in enumerate(("looked_ahead", "launched_ahead", "discarded"))
            },
        }  # fmt: skip


@dataclass
class Costs:
    """Per repeat, interleaved: a 1-token forward's seconds, the (K+1)-token verify over it,
    a head step over it, and a block drafter's pass of K drafts over it."""

    one: Figure = field(default_factory=Figure)
    verify: dict[int, Figure] = field(default_factory=dict)
    delta: Figure = field(default_factory=Figure)
    drafter: dict[int, Figure] = field(default_factory=dict)


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
    acceptances: list[float] | None = None  # --acceptance: synthetic (oracle) drafts
    draft_model: Any = None  # a `mtpkit.bench.draft.DraftModelRun` with --draft-model
    draft_vocab: int | None = None  # ids the head drafts over (None: every token)
    # Stock over itself (`anchors.Anchored.self_ratios`): the noise a speedup carries.
    stock_self: Figure = field(default_factory=Figure)

    @property
    def beta(self) -> Figure:
        return self.costs.verify[1]

    @property
    def stock_token_seconds(self) -> float:
        return 1.0 / self.plain_tps.median if self.plain_tps.median else 0.0

    def reliability(self) -> list[str]:
        """Why the figures mean little, if they do: too few trials, too wide ranges."""
        notes = []
        if self.trials < MIN_TRIALS:
            notes.append(
                f"{self.trials} trial(s) (at least {MIN_TRIALS} for a median to mean much)"
            )
        if self.stock_self.values and self.stock_self.spread > MAX_SPREAD:
            low, high = self.stock_self.range
            notes.append(
                f"stock against itself ranged {low:.2f}-{high:.2f}x: the machine's own noise "
                "is wider than the differences a speedup is read for"
            )
        figures = [("--no-mtp", self.no_mtp_speedup)] + [(_name(r), r.speedup) for r in self.runs]
        if self.draft_model is not None and self.draft_model.speedup.values:
            figures.append(("draft model (stock mlx-lm)", self.draft_model.speedup))
        wide = [f"{name} {f.spread:.0%}" for name, f in figures if f.spread > MAX_SPREAD]
        if wide:
            notes.append(
                f"speedup ranges wider than {MAX_SPREAD:.0%} of the median: {', '.join(wide)}"
            )
        return notes

    def to_json(self) -> dict[str, Any]:
        stock_token = self.stock_token_seconds
        notes = self.reliability()
        return {
            "model": self.model,
            "device": device_name(),
            "mlx": mx.__version__,
            "dtype": self.dtype,
            "moe_dtype": self.moe_dtype,
            "draft_vocab": self.draft_vocab,
            "synthetic": self.acceptances is not None,
            "acceptances": self.acceptances,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "trials": self.trials,
            "reliable": not notes,
            "unreliable_because": notes,
            "plain_tps": self.plain_tps.median,
            "plain_tps_range": self.plain_tps.range,
            "stock_token_ms": stock_token * 1e3,
            "no_mtp_tps": self.no_mtp_tps.median,
            "no_mtp_tps_range": self.no_mtp_tps.range,
            "no_mtp_speedup": self.no_mtp_speedup.median,
            "no_mtp_speedup_range": self.no_mtp_speedup.range,
            "stock_self": self.stock_self.median if self.stock_self.values else None,
            "stock_self_range": self.stock_self.range if self.stock_self.values else None,
            "forward_seconds": self.costs.one.median,
            "beta": self.beta.median,
            "beta_range": self.beta.range,
            "delta": self.costs.delta.median,
            "delta_range": self.costs.delta.range,
            "verify_costs": {str(k + 1): v.median for k, v in self.costs.verify.items()},
            "drafter_costs": {str(k): v.median for k, v in self.costs.drafter.items()},
            "drafter_costs_range": {str(k): v.range for k, v in self.costs.drafter.items()},
            "runs": [r.to_json(stock_token) for r in self.runs if not r.adaptive],
            "adaptive": [r.to_json(stock_token) for r in self.runs if r.adaptive],
            "draft_model": self.draft_model.to_json() if self.draft_model else None,
            "matmul_routes": routes_summary(),
        }


DRAFTERS = {
    "dflash": "DFlash block drafter",
    "draft-model": "draft model",
    "eagle3": "EAGLE-3 drafter",
    "gemma4-assistant": "Gemma 4 assistant",
    "prompt-lookup": "prompt lookup",
}


def _name(r: BenchRun) -> str:
    name = f"depth 1-{r.depth}, adaptive" if r.adaptive else f"depth {r.depth}"
    if r.drafter != "mtp":  # mtpkit with another proposer than the head
        name = f"{DRAFTERS[r.drafter]} (mtpkit), {name}"
    return name if r.oracle is None else f"{name} @{r.oracle:g}"


def print_bench(result: BenchResult) -> None:
    """The table people read (stdout)."""
    from rich.table import Table
    from rich.text import Text

    from mtpkit.core.console import printable, stdout

    costs = result.costs
    stdout.print(
        Text.assemble(
            (printable(result.model), "bold"),
            f" on {device_name()}: prompt {result.prompt_tokens} tokens, {result.max_tokens} "
            f"generated per run, median [min-max] of {result.trials} interleaved trials"
            + (f", experts in {result.moe_dtype}" if result.moe_dtype else ""),
        )
    )
    if result.acceptances is not None:
        stdout.print(
            "SYNTHETIC: oracle drafts (the head runs, its tokens are replaced: right with "
            "the probability in the 'decoding' column); what a head of that acceptance gains"
        )
    verify = ", ".join(f"{k + 1} tokens {v}" for k, v in sorted(costs.verify.items()))
    stdout.print(
        f"stock mlx-lm {result.stock_token_seconds * 1e3:.2f} ms a token in its own loop; "
        f"1-token forward {costs.one.median * 1e3:.2f} ms; beta {result.beta}, delta "
        f"{costs.delta} (verify over a 1-token forward: {verify})"
    )
    if costs.drafter:
        stdout.print(_drafter_costs(result))
    if result.stock_self.values:
        stdout.print(
            f"stock against itself {result.stock_self}x (each stock run inside a trial over "
            "the ones around it, read as a speedup is): the noise every speedup carries"
        )
    table = Table(title_justify="left")
    columns = ("decoding", "tok/s", "vs stock", "acceptance", "by depth", "ms/step", "ceiling")
    for col in (*columns, "of ceiling"):
        justify = "left" if col in ("decoding", "by depth") else "right"
        table.add_column(col, justify=justify, overflow="fold")
    table.add_row("stock mlx-lm", str(result.plain_tps), "1", *[""] * 5)
    table.add_row("--no-mtp", str(result.no_mtp_tps), str(result.no_mtp_speedup), *[""] * 5)
    stock_token = result.stock_token_seconds
    for r in result.runs:
        by_depth = " ".join("-" if a is None else f"{a:.0%}" for a in r.acceptance_by_depth)
        ceiling = r.ceiling_pipelined(stock_token)
        table.add_row(
            _name(r),
            str(r.decode_tps),
            str(r.speedup),
            "-" if r.acceptance is None else f"{r.acceptance:.1%}",
            by_depth,
            f"{r.step_seconds.median * 1e3:.2f}",
            "-" if ceiling is None else f"{ceiling:.2f}",
            "-" if not ceiling else f"{r.speedup.median / ceiling:.0%}",
        )
    if result.draft_model is not None:
        table.add_row(*draft_row(result.draft_model))
    stdout.print(table)
    if result.draft_model is not None and result.draft_model.unavailable:
        stdout.print(f"draft model: {result.draft_model.unavailable}")


def _drafter_costs(result: BenchResult) -> str:
    """The block drafter's line: its pass and the round it makes, in 1-token forwards."""
    costs = result.costs
    passes = ", ".join(f"{k} drafts {v}" for k, v in sorted(costs.drafter.items()))
    rounds = ", ".join(
        f"{k} drafts {costs.verify[k].median + v.median:.3g}"
        for k, v in sorted(costs.drafter.items())
    )
    drafter = next((r.drafter for r in result.runs if r.round_cost is not None), "block")
    return (f"{DRAFTERS.get(drafter, drafter)} pass over a 1-token forward: {passes}; a round "
            f"(verify of K+1 tokens + one pass): {rounds}")  # fmt: skip


def draft_row(run: Any) -> list[str]:
    """The table row of stock mlx-lm with a draft model (its acceptance: tokens from the draft)."""
    name = f"draft model (stock mlx-lm), {run.num_draft_tokens} drafts"
    if run.unavailable:
        return [name, "-", "-", "n/a (below)", "", "", "", ""]
    accepted = "-" if run.acceptance is None else f"{run.acceptance:.1%} drafted"
    return [name, str(run.decode_tps), str(run.speedup), accepted, "", "", "", ""]
