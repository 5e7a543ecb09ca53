"""`mtpkit bench --batch`: batched MTP against stock mlx-lm's batch_generate at each width, in
the same interleaved trials (figures only; no timed assertion)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from tests.checkpoints import CheckpointFactory

runner = CliRunner()


@pytest.fixture(scope="module")
def mimo(checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mimo") / "mlx"
    return convert(str(checkpoint("mimo")), output=out).output


def test_batch_widths_against_stock_batching_as_json(mimo: Path) -> None:
    args = ["bench", "--model", str(mimo), "--batch", "1,3", "--acceptance", "0,1", "--trials",
            "2", "--max-tokens", "6", "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [w["batch"] for w in report["widths"]] == [1, 3]
    assert report["depth"] == 1 and report["trials"] == 2
    assert report["matmul_routes"] == {}  # the multi-row matmul is routed on CUDA only
    for width in report["widths"]:
        assert width["stock_tps"]["median"] > 0
        assert set(width["mtp"]) == set(width["mtp_adaptive"]) == {"0", "1"}
        assert width["mtp"]["0"]["acceptance"] == 0.0  # oracle drafts held to the plan
        assert width["mtp"]["1"]["acceptance"] == 1.0
        assert width["mtp"]["0"]["plain_share"] == 0.0  # drafting every round
        for row in [*width["mtp"].values(), *width["mtp_adaptive"].values()]:
            assert row["tps"]["median"] > 0 and row["speedup"]["median"] > 0
            low, high = row["tps"]["range"]
            assert low <= row["tps"]["median"] <= high
            assert 0.0 <= row["plain_share"] <= 1.0


def test_batch_table_and_bad_widths(mimo: Path) -> None:
    base = ["bench", "--model", str(mimo), "--trials", "1", "--max-tokens", "4"]
    result = runner.invoke(app, [*base, "--batch", "2"])
    assert result.exit_code == 0, result.output
    assert "stock is mlx-lm's batch_generate at the same width" in result.stdout
    assert "MTP (head)" in result.stdout and "MTP (head), adaptive" in result.stdout
    assert "SYNTHETIC" not in result.stdout
    bad = runner.invoke(app, [*base, "--batch", "0,2"])
    assert bad.exit_code == 2
    assert "positive integers" in bad.output


def test_batch_rows_take_the_prompts_in_turn_at_a_context_length(mimo: Path) -> None:
    """Several --prompt are the rows (in turn); --prompt-tokens makes each that long."""
    args = ["bench", "--model", str(mimo), "--batch", "3", "-p", "one prompt", "-p",
            "another, longer prompt of more words", "--trials", "1", "--max-tokens", "4"]  # fmt: skip
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["prompt_tokens"]) == 2  # two lengths
    long = runner.invoke(app, [*args, "--prompt-tokens", "40"])
    assert long.exit_code == 0, long.output
    header = long.stdout.splitlines()[0]
    assert header.startswith(f"{mimo} on ") and "prompt 40 tokens" in header, header
    assert "[bold]" not in header
    single = runner.invoke(app, ["bench", "--model", str(mimo), "-p", "a", "-p", "b"])
    assert single.exit_code == 2
    assert "several --prompt are the rows of --batch" in single.output


def test_an_untimed_trial_first_is_left_out_of_the_figures(mimo: Path) -> None:
    """What a GPU runs by default (first-use kernel builds kept out of the trials): one whole
    trial, every width and configuration, whose figures are not counted."""
    from mtpkit.bench.batch import bench_batch

    lines: list[str] = []
    result = bench_batch(mimo, widths=[1, 2], prompts=["hello"], max_tokens=5, trials=2,
                         acceptances=[1.0], progress=lines.append, warm_trial=True)  # fmt: skip
    untimed = [line for line in lines if line.startswith("untimed trial:")]
    assert len(untimed) == 2 * 3  # two widths: stock and two MTP configurations each
    assert len(lines) == 3 * len(untimed)  # then the two counted trials
    for run in result.runs:
        assert len(run.stock_tps.values) == 2
        assert all(len(f.values) == 2 for f in run.speedup.values())
