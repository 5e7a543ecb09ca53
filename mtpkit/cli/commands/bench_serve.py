"""`mtpkit bench --serve`'s options and its body (the rest of `bench` is in bench.py)."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Annotated

import typer

from mtpkit.cli.values import ranged

ServeOpt = Annotated[
    bool,
    typer.Option(
        "--serve",
        help="Measure serving instead: mtpkit serve against mlx_lm.server on the same model "
        "directory, both started here (127.0.0.1, free ports), at each --clients level: "
        "TTFT, inter-token latency per token and per chunk, tok/s per request and in all, "
        "requests/s (p50/p90/p99), tokens from the servers' usage. With --acceptance A (one "
        "value): SYNTHETIC, mtpkit serve --oracle-acceptance A, every timed prompt answered "
        "once untimed first, the acceptance realized reported.",
    ),
]
ClientsOpt = Annotated[
    str,
    typer.Option("--clients", metavar="C[,D...]", help="With --serve: the concurrency levels."),
]
RoundsOpt = Annotated[
    int,
    typer.Option(
        "--rounds",
        **ranged(int, min=1),
        metavar="N",
        help="With --serve: rounds per server and level (the servers' rounds interleaved).",
    ),  # fmt: skip
]
LongPromptOpt = Annotated[
    int,
    typer.Option(
        "--long-prompt-tokens",
        **ranged(int, min=0),
        metavar="N",
        help="With --serve, from 2 clients on: one more client with a prompt of about N "
        "tokens, sent once the others decode (0: none).",
    ),  # fmt: skip
]
ServeArgsOpt = Annotated[
    str,
    typer.Option(
        "--serve-args",
        metavar="ARGS",
        help="With --serve: more arguments for mtpkit serve (default: --decode-concurrency "
        "at the highest level).",
    ),  # fmt: skip
]
MlxLmArgsOpt = Annotated[
    str,
    typer.Option(
        "--mlx-lm-args",
        metavar="ARGS",
        help="With --serve: more arguments for mlx_lm.server (default: --decode-concurrency "
        "at the highest level).",
    ),  # fmt: skip
]


def server_args(extra: str, levels: list[int]) -> list[str]:
    """`extra` split as a shell would, with --decode-concurrency at the highest level unless
    `extra` sets it."""
    args = shlex.split(extra)
    if not any(a.split("=")[0] == "--decode-concurrency" for a in args):
        args += ["--decode-concurrency", str(max(levels))]
    return args


def serve_acceptance(acceptances: list[float] | None, serve_args: str) -> float | None:
    """--acceptance A with --serve: one value, which mtpkit serve gets as --oracle-acceptance
    (so --serve-args must not set it); None without it."""
    if acceptances is None:
        return None
    if len(acceptances) > 1:
        raise typer.BadParameter("--serve takes one value", param_hint="--acceptance")
    if any(a.split("=")[0] == "--oracle-acceptance" for a in shlex.split(serve_args)):
        raise typer.BadParameter(
            "--acceptance sets mtpkit serve's --oracle-acceptance: leave it out of --serve-args",
            param_hint="--acceptance",
        )
    return acceptances[0]


def run_serve_bench(
    model: str, levels: list[int], *, rounds: int, max_tokens: int, long_prompt_tokens: int,
    serve_args: str, mlx_lm_args: str, json_output: bool, progress: Callable[[str], None],
    name: str | None, acceptance: float | None = None,
) -> None:  # fmt: skip
    from mtpkit.bench.serve import ServeBenchSettings, bench_serve
    from mtpkit.bench.serve_report import print_serve_bench
    from mtpkit.cli.output import print_json

    settings = ServeBenchSettings(
        model=model, levels=tuple(levels), rounds=rounds, max_tokens=max_tokens,
        long_prompt_tokens=long_prompt_tokens, mtpkit_args=server_args(serve_args, levels),
        mlx_lm_args=server_args(mlx_lm_args, levels), oracle_acceptance=acceptance,
    )  # fmt: skip
    result = bench_serve(settings, progress)
    if name is not None:
        result["model"] = name
    if json_output:
        print_json(result)
    else:
        print_serve_bench(result)
