"""`mtpkit bench --serve`: both servers started, driven, stopped; its figures against what
mlx_lm.server's own answers say (the same greedy texts, the same usage counts) and its
percentiles against numpy's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mtpkit.bench.serve import FIGURES, percentiles
from mtpkit.cli.app import app

runner = CliRunner()


def test_percentiles_match_numpy() -> None:
    values = [0.3, 0.01, 5.0, 0.2, 0.2, 1.5, 0.7]
    got = percentiles(values)
    for p in (50, 90, 99):
        assert got[f"p{p}"] == pytest.approx(float(np.percentile(values, p)))
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--serve", "--batch", "2"], "--serve takes none of"),
        (["--serve", "--prompt-lookup"], "--serve takes none of"),
        (["--serve", "--acceptance", "0.5,0.8"], "--serve takes one value"),
        (
            ["--serve", "--acceptance", "0.8", "--serve-args", "--oracle-acceptance 0.5"],
            "leave it out of --serve-args",
        ),
        (["--serve", "--clients", "0,2"], "takes positive integers"),
    ],
)
def test_bad_serve_options_are_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--model", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_serve_bench_against_mlx_lm_server(converted: Path) -> None:
    args = [
        "bench", "--serve", "--model", str(converted), "--clients", "1,2", "--rounds", "1",
        "--max-tokens", "16", "--long-prompt-tokens", "64", "--json",
    ]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mtpkit_args"] == ["--decode-concurrency", "2"]
    assert out["synthetic"] is None  # the head's own drafts
    assert [level["clients"] for level in out["levels"]] == [1, 2]
    for level in out["levels"]:
        a, b = level["mtpkit"], level["mlx_lm"]
        # From 2 clients on, one more: the late long prompt.
        expected = level["clients"] + (level["clients"] > 1)
        assert a["requests"] == b["requests"] == expected
        # Greedy: mtpkit's texts are mlx_lm.server's, and so are the usage counts.
        assert level["equal_texts"] == expected
        assert a["output_tokens"] == b["output_tokens"] > 0
        assert a["prompt_tokens"] == b["prompt_tokens"]
        for r in (a, b):
            assert set(FIGURES) <= set(r)
            assert r["output_tps"] == pytest.approx(r["output_tokens"] / r["wall_s"])
            assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] <= r["latency_s"]["p99"]
        assert a["draft_acceptance_rate"] is not None  # mtpkit's own responses say so
        assert b["draft_acceptance_rate"] is None
        late = level["clients"] > 1
        assert (a["long_prompt_ttft_s"] is not None) == late
        assert level["ratio_output_tps"] == pytest.approx(a["output_tps"] / b["output_tps"])
    # The late client's prompt is longer than any of the others' (usage, per server).
    two = out["levels"][1]["mtpkit"]
    assert two["prompt_tokens"] > 64


def test_serve_bench_synthetic_acceptance(converted: Path) -> None:
    """`--acceptance A`: mtpkit serve with oracle drafts (`--oracle-acceptance A`) on every
    timed request, after an untimed round of each prompt; texts still mlx_lm.server's, and
    at A = 1 every first draft is kept (the plan keeps each, whatever the head drafted)."""
    args = [
        "bench", "--serve", "--model", str(converted), "--clients", "1,2", "--rounds", "1",
        "--max-tokens", "16", "--long-prompt-tokens", "64", "--acceptance", "1",
        "--serve-args", "--no-adaptive --depth 2", "--json",
    ]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mtpkit_args"] == [
        "--no-adaptive", "--depth", "2", "--decode-concurrency", "2", "--oracle-acceptance", "1",
    ]  # fmt: skip
    synthetic = out["synthetic"]
    assert synthetic["oracle_acceptance"] == 1.0 and "SYNTHETIC" in synthetic["note"]
    assert synthetic["realized_acceptance"] == 1.0
    assert synthetic["oracle_requests"] == synthetic["requests"] == 1 + 3
    for level in out["levels"]:
        a, b = level["mtpkit"], level["mlx_lm"]
        assert a["oracle_requests"] == a["requests"] and b["oracle_requests"] == 0
        assert a["first_draft_acceptance"] == 1.0 and b["first_draft_acceptance"] is None
        assert level["equal_texts"] == a["requests"]  # greedy: mlx_lm.server's texts
        assert a["output_tokens"] == b["output_tokens"] > 0
