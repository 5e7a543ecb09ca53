"""`mtpkit bench --serve`: `mtpkit serve` against `mlx_lm.server` on the same model directory,
many clients at once, in the field's terms.

Both servers run for the whole benchmark (`serve_servers.py`); at each concurrency level C,
rounds of C clients, each sending one streamed greedy completion of a prompt of mixed length
(`serve_load.py`), and, from C = 2 on, one more client whose long prompt is sent once the
others have their first token (it joins while they decode: its TTFT is the join's cost, the
others' inter-chunk gaps its stall). The two servers' rounds alternate (which goes first
alternates too), so that a busy machine slows both alike. Per server and level: TTFT,
inter-token latency per token (TPOT) and per chunk, per-request decode tok/s, end-to-end
latency, at p50/p90/p99 over every request of the level's rounds; output tok/s in all (the
rounds' usage tokens over their wall time) and requests/s; the ratios mtpkit/mlx_lm. With
`oracle_acceptance` the figures are SYNTHETIC: mtpkit serve drafts with oracle drafts at that
acceptance (`serve_oracle.py`).
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit.bench.serve_load import (
    Sample,
    ServeBenchError,
    level_prompts,
    long_prompt,
    mixed_prompts,
    run_round,
)
from mtpkit.bench.serve_oracle import first_draft_acceptance, synthetic_summary, warm_up
from mtpkit.bench.serve_servers import ServerProcess, start_servers

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
SERVERS = ("mtpkit", "mlx_lm")
PERCENTILES = (50, 90, 99)
# The per-request figures each level reports, by their JSON key.
FIGURES: dict[str, Callable[[Sample], float | list[float] | None]] = {
    "ttft_s": lambda s: s.ttft,
    "tpot_s": lambda s: s.tpot,
    "itl_chunk_s": lambda s: s.chunk_gaps,
    "decode_tps": lambda s: s.decode_tps,
    "latency_s": lambda s: s.latency,
}


@dataclass
class ServeBenchSettings:
    model: str
    levels: tuple[int, ...] = DEFAULT_LEVELS
    rounds: int = 2  # per server and level
    max_tokens: int = 128
    long_prompt_tokens: int = 1024  # 0: no late long-prompt client
    mtpkit_args: list[str] = field(default_factory=list)
    mlx_lm_args: list[str] = field(default_factory=list)
    # SYNTHETIC: mtpkit serve's oracle drafts right at this share (`serve_oracle.py`): it
    # runs with --oracle-acceptance (added to `mtpkit_args`).
    oracle_acceptance: float | None = None

    def mtpkit_command_args(self) -> list[str]:
        """What mtpkit serve is started with: `mtpkit_args`, and the oracle's flag."""
        if self.oracle_acceptance is None:
            return list(self.mtpkit_args)
        return [*self.mtpkit_args, "--oracle-acceptance", f"{self.oracle_acceptance:g}"]


@dataclass
class LevelRuns:
    """One level's samples and round wall times, per server."""

    clients: int
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {n: [] for n in SERVERS})
    walls: dict[str, list[float]] = field(default_factory=lambda: {n: [] for n in SERVERS})
    errors: dict[str, list[str]] = field(default_factory=lambda: {n: [] for n in SERVERS})


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    ordered = sorted(values)
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        rank = (len(ordered) - 1) * p / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        out[f"p{p}"] = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return out


def summarize_server(
    samples: list[Sample], walls: list[float], errors: list[str] | None = None
) -> dict[str, Any]:
    """A server's figures at one level (stable JSON keys); `requests` counts those answered,
    `errors` those that failed."""
    out: dict[str, Any] = {"requests": len(samples), "errors": len(errors or []),
                           "wall_s": sum(walls)}  # fmt: skip
    for key, figure in FIGURES.items():
        values: list[float] = []
        for s in samples:
            v = figure(s)
            values += v if isinstance(v, list) else ([] if v is None else [v])
        out[key] = percentiles(values)
    tokens = sum(s.tokens for s in samples)
    out["output_tokens"] = tokens
    out["prompt_tokens"] = sum(s.prompt_tokens for s in samples)
    out["output_tps"] = tokens / out["wall_s"] if out["wall_s"] else None
    out["requests_per_s"] = len(samples) / out["wall_s"] if out["wall_s"] else None
    late = [s.ttft for s in samples if s.long_prompt]
    out["long_prompt_ttft_s"] = statistics.median(late) if late else None
    specs = [s.spec for s in samples if s.spec]
    drafted = sum(x["num_draft_tokens"] for x in specs)
    accepted = sum(x["num_accepted_draft_tokens"] for x in specs)
    out["draft_acceptance_rate"] = accepted / drafted if drafted else None
    out["first_draft_acceptance"] = first_draft_acceptance(samples)
    out["oracle_requests"] = sum(s.synthetic is not None for s in samples)
    return out


def summarize(runs: LevelRuns) -> dict[str, Any]:
    a, b = (summarize_server(runs.samples[n], runs.walls[n], runs.errors[n]) for n in SERVERS)
    # The same prompt went to both servers as the same round's same client.
    theirs = {(s.round, s.client): s.text for s in runs.samples["mlx_lm"]}
    equal = sum(theirs.get((s.round, s.client)) == s.text for s in runs.samples["mtpkit"])
    return {
        "clients": runs.clients,
        "mtpkit": a,
        "mlx_lm": b,
        "ratio_output_tps": _ratio(a["output_tps"], b["output_tps"]),
        "ratio_ttft_p50": _ratio(a["ttft_s"]["p50"], b["ttft_s"]["p50"]),
        "ratio_decode_tps_p50": _ratio(a["decode_tps"]["p50"], b["decode_tps"]["p50"]),
        "equal_texts": equal,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def bench_serve(
    settings: ServeBenchSettings, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Start both servers, drive every level, stop them; the results as JSON-ready dicts."""
    say = progress or (lambda _line: None)
    work = Path(tempfile.mkdtemp(prefix="mtpkit-serve-bench-"))
    say(f"starting mtpkit serve and mlx_lm.server on {settings.model} (logs in {work})")
    mtpkit_args = settings.mtpkit_command_args()
    servers = start_servers(settings.model, work, mtpkit_args, settings.mlx_lm_args)
    levels, timed = [], []
    try:
        for server in servers:  # warm-up: first graphs, caches
            _, _, errors = run_round(server.url, settings.model, mixed_prompts(2), 16)
            if errors:
                raise ServeBenchError(f"{server.name} failed its warm-up: {errors[0]}")
        if settings.oracle_acceptance is not None:
            say("SYNTHETIC: every timed prompt answered once first (the oracle drafts over it)")
            warm_up(servers, settings)
        for clients in settings.levels:
            say(f"{clients} client(s): {settings.rounds} round(s) per server")
            runs = _drive_level(servers, settings, clients)
            for name, errors in runs.errors.items():
                if errors:
                    say(f"{name}: {len(errors)} request(s) failed, the first: {errors[0]}")
            levels.append(summarize(runs))
            timed += runs.samples["mtpkit"]
    finally:
        for server in servers:
            server.stop()
    synthetic = None
    if settings.oracle_acceptance is not None:
        synthetic = synthetic_summary(settings.oracle_acceptance, timed)
        if synthetic["oracle_requests"] < synthetic["requests"]:
            say(f"{synthetic['requests'] - synthetic['oracle_requests']} timed request(s) "
                "decoded without oracle drafts (no answer of their prompt was kept)")  # fmt: skip
    return {
        "model": settings.model,
        "max_tokens": settings.max_tokens,
        "rounds": settings.rounds,
        "long_prompt_tokens": settings.long_prompt_tokens,
        "mtpkit_args": mtpkit_args,
        "mlx_lm_args": settings.mlx_lm_args,
        "synthetic": synthetic,  # None: the head's own drafts
        "levels": levels,
    }


def _drive_level(
    servers: list[ServerProcess], settings: ServeBenchSettings, clients: int
) -> LevelRuns:
    runs = LevelRuns(clients)
    late = long_prompt(settings.long_prompt_tokens) if settings.long_prompt_tokens else None
    for r in range(settings.rounds):
        prompts = level_prompts(clients, r)
        order = servers if r % 2 == 0 else servers[::-1]
        for server in order:  # interleaved rounds
            samples, wall, errors = run_round(
                server.url, settings.model, prompts, settings.max_tokens,
                late if clients > 1 else None,
            )  # fmt: skip
            for sample in samples:
                sample.round = r
            runs.samples[server.name] += samples
            runs.walls[server.name].append(wall)
            runs.errors[server.name] += errors
    return runs
