"""`mtpkit bench --batch 1,2,4,8`: batched MTP decoding against stock mlx-lm's own batched
decoding (`mlx_lm.batch_generate`, its `BatchGenerator`) at the same width.

Each trial runs, at every width B, stock's `batch_generate` over B copies of the prompt on an
untouched load of the directory, then mtpkit's `BatchDecoder` over the same B rows at depth 1,
drafting every round and with adaptive drafting (decided per width, `speculative/batch/
adaptive.py`), each with the head's drafts or at each `--acceptance` (oracle drafts per row,
`mtpkit.speculative.oracle`), so a
disturbance of the machine hits both alike. The figures are aggregate decode tok/s (tokens
after each row's first over the decoding time, as stock's `generation_tps` counts them), per
request (aggregate / B), and MTP's ratio to stock at the same width in the same trial.
With `--prompt-lookup` the rows draft by prompt lookup (each row over its own prompt and
output), with `--draft-model DIR` by that draft model (each row with its own caches),
instead of the head.
Both run with Python's collector off, as one stream's runs do (`speed.collector_off`).
On a GPU one whole trial runs untimed first: a shape met for the first time builds its
kernels there (seconds each; on a fresh CUDA machine a batched round's first use took 54 s),
and the rounds of a trial meet shapes a short warm-up does not.

Every row continues from its prompt prefilled once (`mtpkit.bench.prefilled`, as one stream's
runs do): stock's rows from a fork of mlx-lm's cache after all but the prompt's last token
(`batch_generate`'s `prompt_caches`), mtpkit's from a prompt-cache entry one token shorter
(`BatchDecoder.add(cached=)`: each row prefills that token, as a conversation's next turn
joins a batch). No figure times a prefill; at 4096 tokens on MLX's CUDA build one costs
seconds a row (mlx-lm updates a gated-delta-net token by token there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.bench.prefilled import Prefilled
from mtpkit.bench.report import MAX_SPREAD, MIN_TRIALS, Figure, device_name
from mtpkit.bench.speed import collector_off, prompt_of_length
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.kernels.routing import routes_summary
from mtpkit.runtime.model import MtpModel, NoMtpHead, library_io, load_model
from mtpkit.runtime.upcast import upcast_experts
from mtpkit.speculative.batch import BatchDecoder, Row
from mtpkit.speculative.batch.rounds import RowDraftFilter, RowPlan
from mtpkit.speculative.oracle import OracleDrafts
from mtpkit.speculative.prompt_cache import CachedState
from mtpkit.speculative.proposers import Proposer, default_proposer
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.session import check_prompt

# (oracle acceptance or None for the head's drafts, adaptive drafting): one MTP run a trial.
Config = tuple[float | None, bool]


@dataclass
class WidthRun:
    """One width's figures over the trials: stock and MTP in each configuration."""

    width: int
    stock_tps: Figure = field(default_factory=Figure)
    mtp_tps: dict[Config, Figure] = field(default_factory=dict)
    speedup: dict[Config, Figure] = field(default_factory=dict)
    acceptance: dict[Config, list[float]] = field(default_factory=dict)
    plain_share: dict[Config, list[float]] = field(default_factory=dict)  # of the steps


@dataclass
class BatchBenchResult:
    model: str
    prompt_tokens: list[int]  # the prompts' lengths (one unless they differ)
    max_tokens: int
    trials: int
    depth: int
    acceptances: list[float | None]
    runs: list[WidthRun]
    drafter: str = "mtp"  # what drafts the rows (`ProposerFactory.name`)

    @property
    def configs(self) -> list[Config]:
        return [(a, adaptive) for a in self.acceptances for adaptive in (False, True)]

    def reliability(self) -> list[str]:
        """Why the figures mean little, if they do, as one stream's bench says it: too few
        trials, speedup ranges too wide."""
        notes = []
        if self.trials < MIN_TRIALS:
            notes.append(
                f"{self.trials} trial(s) (at least {MIN_TRIALS} for a median to mean much)"
            )
        wide = [
            f"batch {r.width} {'adaptive' if adaptive else 'MTP'}"
            f"{'' if a is None else f' @{a:g}'} {f.spread:.0%}"
            for r in self.runs
            for (a, adaptive), f in r.speedup.items()
            if f.spread > MAX_SPREAD
        ]
        if wide:
            notes.append(
                f"speedup ranges wider than {MAX_SPREAD:.0%} of the median: {', '.join(wide)}"
            )
        return notes

    def to_json(self) -> dict[str, Any]:
        def fig(f: Figure) -> dict[str, Any]:
            return {"median": f.median, "range": f.range}

        def key(a: float | None) -> str:  # the drafter's own drafts, or an oracle's
            return ("head" if self.drafter == "mtp" else self.drafter) if a is None else f"{a:g}"

        return {
            "model": self.model,
            "device": device_name(),
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "trials": self.trials,
            "reliable": not self.reliability(),
            "unreliable_because": self.reliability(),
            "depth": self.depth,
            "drafter": self.drafter,
            "matmul_routes": routes_summary(),
            "widths": [
                {
                    "batch": r.width,
                    "stock_tps": fig(r.stock_tps),
                    "stock_tps_per_request": r.stock_tps.median / r.width,
                    **{
                        "mtp_adaptive" if adaptive else "mtp": {
                            key(a): {
                                "tps": fig(r.mtp_tps[a, adaptive]),
                                "tps_per_request": r.mtp_tps[a, adaptive].median / r.width,
                                "speedup": fig(r.speedup[a, adaptive]),
                                "acceptance": _mean(r.acceptance[a, adaptive]),
                                "plain_share": _mean(r.plain_share[a, adaptive]),
                            }
                            for a in self.acceptances
                        }
                        for adaptive in (False, True)
                    },
                }
                for r in self.runs
            ],
        }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def stock_batch_tps(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    max_tokens: int,
    caches: list[list[Any] | None] | None = None,
) -> float:
    """Aggregate decode tok/s of stock mlx-lm's `batch_generate` (its own `generation_tps`).
    `caches`: per row, mlx-lm's cache after all but its prompt's last token (the only one
    then fed), or None for every row (each prefills its whole prompt)."""
    import mlx_lm

    fed: list[list[int]] = prompts
    if caches is not None and all(c is not None for c in caches):
        fed = [p[-1:] for p in prompts]
    else:
        caches = None
    with collector_off():
        response = mlx_lm.batch_generate(
            model, tokenizer, fed, prompt_caches=caches, max_tokens=max_tokens
        )
    return float(response.stats.generation_tps)


def oracle_hooks(oracles: list[OracleDrafts]) -> tuple[RowDraftFilter, RowPlan]:
    """A `BatchDecoder`'s `draft_filter` and `plan` holding row i (its uid, rows joined in
    order) to `oracles[i]`."""
    planned = [oracle.for_rows() for oracle in oracles]

    def draft_filter(row: Row, position: mx.array, drafts: mx.array) -> mx.array:
        return planned[row.uid].drafts(position, drafts)

    def plan(row: Row, depth: int) -> int:
        return planned[row.uid].planned(depth)

    return draft_filter, plan


def mtp_batch_run(
    m: MtpModel,
    prompts: list[list[int]],
    depth: int,
    max_tokens: int,
    oracles: list[OracleDrafts] | None = None,
    adaptive: bool = False,
    ahead: bool = True,
    policy: Any = None,
    cached: list[CachedState | None] | None = None,
    proposers: Callable[[], Proposer] | None = None,
) -> tuple[float, float | None, float]:
    """Aggregate decode tok/s of `BatchDecoder` over `prompts` (every row joined before the
    first round; each row's first token, from its prefill, not counted), its acceptance and
    the share of its steps that were plain. `policy`: the decoder's drafting policy (bench
    scripts' A/B), else `adaptive`'s; `cached`: per row, a prompt-cache entry its prompt
    extends (`_Context.entries`), else each row prefills its whole prompt; `proposers`: what
    drafts (default: the head)."""
    draft_filter, plan = oracle_hooks(oracles) if oracles is not None else (None, None)
    decoder = BatchDecoder(
        m,
        depth=depth,
        draft_filter=draft_filter,
        plan=plan,
        adaptive=adaptive,
        policy=policy,
        ahead=ahead,
        proposers=proposers,
    )
    with collector_off():
        entries = cached or [None] * len(prompts)
        rows = [
            decoder.add(p, max_tokens=max_tokens, cached=c)
            for p, c in zip(prompts, entries, strict=True)
        ]
        start = time.perf_counter()
        while decoder.rows:
            decoder.step()
        elapsed = time.perf_counter() - start
    tokens = sum(max(0, len(r.tokens) - 1) for r in rows)
    drafted = sum(r.drafted for r in rows)
    acceptance = sum(r.accepted for r in rows) / drafted if drafted else None
    steps = decoder.plain_steps + max(r.rounds for r in rows)
    plain = decoder.plain_steps / steps if steps else 0.0
    return (tokens / elapsed if elapsed > 0 else 0.0), acceptance, plain


def bench_batch(
    model: str | Path,
    *,
    widths: list[int],
    prompts: list[str],
    prompt_tokens: int | None = None,
    synthetic: bool = False,
    max_tokens: int = 128,
    trials: int = 3,
    depth: int = 1,
    acceptances: list[float] | None = None,
    chat_template: bool = True,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    warm_trial: bool | None = None,
    drafter: DrafterChoice | None = None,
) -> BatchBenchResult:
    """Batched MTP against stock mlx-lm's batched decoding at each width (module's text).
    Row i decodes `prompts[i % len(prompts)]`; `prompt_tokens`: each prompt made that long
    (`prompt_of_length`; `synthetic`: random ids, a random-weight model's context).
    `warm_trial` (default: on a GPU) runs one whole trial untimed first: there a shape met
    for the first time builds its kernels, seconds each, which short warm-ups miss (a round
    whose rows keep new counts, a key length not seen). `drafter`: what drafts the rows
    (default: the head; prompt lookup and a draft model batch too)."""
    if trials < 1 or max_tokens < 2 or not widths or min(widths) < 1 or not prompts:
        raise MtpkitError("--batch takes widths of at least 1; trials >= 1, max-tokens >= 2")
    say = progress or (lambda s: None)
    drafter = drafter or DrafterChoice()
    if not drafter.uses_head and acceptances:
        raise MtpkitError(f"--acceptance replaces the head's drafts: drop --{drafter.name}")
    m = load_model(model, with_head=drafter.uses_head)
    if drafter.uses_head and m.head is None:
        raise NoMtpHead(f"{m.path} has no MTP head: run `mtpkit inspect` and `mtpkit convert`")
    factory = ProposerFactory(m, drafter)
    import mlx_lm

    with library_io():
        stock_model, stock_tokenizer = mlx_lm.load(
            str(m.path), tokenizer_config={"trust_remote_code": False}
        )
    upcast_experts([stock_model], what=str(m.path))
    eos = m.tokenizer.eos_token_ids
    m.tokenizer.eos_token_ids = stock_tokenizer.eos_token_ids = []  # every row runs max_tokens
    try:
        vocab = int(m.embedding.weight.shape[0])
        encoded = [encode_prompt(m.tokenizer, p, chat_template=chat_template) for p in prompts]
        if prompt_tokens is not None:
            encoded = [
                prompt_of_length(
                    t, prompt_tokens, vocab=vocab if synthetic else None, seed=seed + i
                )
                for i, t in enumerate(encoded)
            ]
        for tokens in encoded:
            check_prompt(m, tokens)
        references = [  # each prompt's greedy tokens: what the oracle's right drafts are
            [r.token for r in mlx_lm.stream_generate(
                stock_model, stock_tokenizer, mx.array(t), max_tokens=max_tokens + 8)]
            for t in encoded
        ]  # fmt: skip

        kinds: list[float | None] = list(acceptances) if acceptances is not None else [None]
        runs = [WidthRun(w) for w in widths]
        lengths = sorted({len(t) for t in encoded})
        result = BatchBenchResult(str(model), lengths, max_tokens, trials, depth, kinds, runs,
                                  factory.name)  # fmt: skip
        context = _Context(m, stock_model, stock_tokenizer, encoded, references, max_tokens, seed,
                           [Prefilled(m, t) for t in encoded], factory)  # fmt: skip
        if warm_trial is None:
            warm_trial = device_name() == "gpu"
        if warm_trial:  # a whole trial untimed: every shape the trials meet is built first
            _trial(context, result, "untimed trial:", say, record=False)
        else:  # kernel builds at each width fall outside the trials
            for run in runs:
                rows = context.rows(run.width)
                stock_batch_tps(stock_model, stock_tokenizer, rows, 8, context.caches(run.width))
                mtp_batch_run(m, rows, depth, 8, cached=context.entries(run.width),
                              proposers=factory)  # fmt: skip
        for trial in range(trials):
            _trial(context, result, f"trial {trial + 1}/{trials}:", say)
        return result
    finally:
        m.tokenizer.eos_token_ids = eos


@dataclass
class _Context:
    """What every trial decodes: the two loads, the prompts, their greedy references and
    their prefilled states (`Prefilled`, one per prompt)."""

    m: MtpModel
    stock_model: Any
    stock_tokenizer: Any
    encoded: list[list[int]]
    references: list[list[int]]
    max_tokens: int
    seed: int
    prefilled: list[Prefilled]
    proposers: ProposerFactory | None = None  # what drafts (None: the head)

    def rows(self, width: int) -> list[list[int]]:
        return [self.encoded[i % len(self.encoded)] for i in range(width)]

    def caches(self, width: int) -> list[list[Any] | None]:
        """Per row, a fork of stock's cache after all but its prompt's last token."""
        n = len(self.encoded)
        return [self.prefilled[i % n].stock_cache(self.stock_model) for i in range(width)]

    def entries(self, width: int) -> list[CachedState | None]:
        """Per row, a prompt-cache entry of its prompt but the last token
        (`Prefilled.cache_entry`), as `BatchDecoder.add(cached=)` continues from one: the
        row prefills one token (None: a cache that cannot be forked, the row prefills)."""
        n = len(self.encoded)
        name = self.proposers.name if self.proposers is not None else "mtp"
        make = self.proposers or partial(default_proposer, self.m)
        return [self.prefilled[i % n].cache_entry(name, make) for i in range(width)]


def _trial(
    c: _Context,
    result: BatchBenchResult,
    at: str,
    say: Callable[[str], None],
    record: bool = True,
) -> None:
    """One trial: at each width, stock's batch_generate, then MTP in every configuration;
    their figures added to `result` (unless `record` is off: a warm-up)."""
    vocab = int(c.m.embedding.weight.shape[0])
    for run in result.runs:
        batch = c.rows(run.width)
        base = stock_batch_tps(
            c.stock_model, c.stock_tokenizer, batch, c.max_tokens, c.caches(run.width)
        )
        if record:
            run.stock_tps.values.append(base)
        say(f"{at} batch {run.width} stock mlx-lm {base:.1f} tok/s")
        for config in result.configs:
            a, adaptive = config
            oracles = None
            if a is not None:
                n = len(c.encoded)
                oracles = [
                    OracleDrafts(c.references[i % n], len(batch[i]), a, vocab, c.seed + i)
                    for i in range(run.width)
                ]
            rate, accepted, plain = mtp_batch_run(
                c.m,
                batch,
                result.depth,
                c.max_tokens,
                oracles,
                adaptive,
                cached=c.entries(run.width),
                proposers=c.proposers,
            )
            say(f"{at} batch {run.width} {_name(config, result.drafter)} {rate:.1f} tok/s")
            if not record:
                continue
            run.mtp_tps.setdefault(config, Figure()).values.append(rate)
            run.speedup.setdefault(config, Figure()).values.append(rate / base if base else 0.0)
            run.acceptance.setdefault(config, [])
            if accepted is not None:
                run.acceptance[config].append(accepted)
            run.plain_share.setdefault(config, []).append(plain)


def _name(config: Config, drafter: str = "mtp") -> str:
    a, adaptive = config
    drafts = "MTP (head)" if drafter == "mtp" else drafter
    name = drafts if a is None else f"MTP at oracle {a:g}"
    return f"{name}, adaptive" if adaptive else name


def print_batch_bench(result: BatchBenchResult) -> None:
    """The table people read (stdout)."""
    from rich.table import Table
    from rich.text import Text

    from mtpkit.core.console import printable, stdout

    stdout.print(
        Text.assemble(
            (printable(result.model), "bold"),
            f" on {device_name()}: batched decoding, prompt "
            f"{'/'.join(map(str, result.prompt_tokens))} tokens, {result.max_tokens} generated "
            f"per request, MTP depth {result.depth}, median [min-max] of {result.trials} "
            "interleaved trials; stock is mlx-lm's batch_generate at the same width",
        )
    )
    if any(a is not None for a in result.acceptances):
        stdout.print("SYNTHETIC: oracle drafts per row, right with the probability shown")
    table = Table(title_justify="left")
    columns = ("batch", "decoding", "tok/s", "per request", "vs stock", "acceptance", "plain")
    for col in columns:
        table.add_column(col, justify="left" if col == "decoding" else "right")
    for r in result.runs:
        base = r.stock_tps
        table.add_row(str(r.width), "stock mlx-lm", str(base), f"{base.median / r.width:.3g}",
                      "1", "", "")  # fmt: skip
        for config in result.configs:
            accepted = _mean(r.acceptance[config])
            table.add_row(
                "",
                _name(config, result.drafter),
                str(r.mtp_tps[config]),
                f"{r.mtp_tps[config].median / r.width:.3g}",
                str(r.speedup[config]),
                "-" if accepted is None else f"{accepted:.1%}",
                f"{_mean(r.plain_share[config]):.0%}",
            )
    stdout.print(table)
