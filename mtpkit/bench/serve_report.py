"""The table people read for `mtpkit bench --serve` (stdout); `--json` prints the result of
`bench_serve` itself."""

from __future__ import annotations

from typing import Any

from mtpkit.bench.serve import SERVERS


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_serve_bench(result: dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    from mtpkit.bench.report import device_name
    from mtpkit.core.console import printable, stdout

    late = result["long_prompt_tokens"]
    stdout.print(
        Text.assemble(
            (printable(result["model"]), "bold"),
            f" on {device_name()}: streamed greedy completions of {result['max_tokens']} "
            f"tokens, {result['rounds']} interleaved round(s) per level"
            + (f", one late client with a ~{late}-token prompt from 2 clients on" if late else "")
            + "; times in ms: p50 p90 p99 over every request",
        )
    )
    synthetic = result.get("synthetic")
    if synthetic is not None:
        realized = synthetic["realized_acceptance"]
        stdout.print(
            f"SYNTHETIC: mtpkit serve with oracle drafts at acceptance "
            f"{synthetic['oracle_acceptance']:g} (realized "
            f"{'-' if realized is None else f'{realized:.2f}'}: the first draft's share kept; "
            f"{synthetic['oracle_requests']}/{synthetic['requests']} timed requests drafted "
            "by the oracle): what a head of that acceptance would serve"
        )
    table = Table(title_justify="left")
    columns = (
        "clients", "server", "out tok/s", "req/s", "TTFT ms", "TPOT ms", "ITL/chunk ms",
        "tok/s/req", "late TTFT ms", "accepted", "failed",
    )  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col == "server" else "right", overflow="fold")
    for level in result["levels"]:
        for name in SERVERS:
            r = level[name]
            table.add_row(
                str(level["clients"]), name, _num(r["output_tps"]), _num(r["requests_per_s"], 2),
                _triple(r["ttft_s"]), _triple(r["tpot_s"]), _triple(r["itl_chunk_s"]),
                _num(r["decode_tps"]["p50"]), _ms(r["long_prompt_ttft_s"]),
                "-" if r["draft_acceptance_rate"] is None else f"{r['draft_acceptance_rate']:.0%}",
                str(r["errors"]),
            )  # fmt: skip
        table.add_row(
            "", "ratio", _ratio(level["ratio_output_tps"]), "",
            _ratio(level["ratio_ttft_p50"]), "", "", _ratio(level["ratio_decode_tps_p50"]), "",
            f"same text {level['equal_texts']}/{level['mtpkit']['requests']}", "",
            end_section=True,
        )  # fmt: skip
    stdout.print(table)


def _triple(p: dict[str, float | None]) -> str:
    return " ".join(_ms(p[k]) for k in ("p50", "p90", "p99"))
