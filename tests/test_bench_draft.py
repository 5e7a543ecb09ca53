"""`mtpkit bench --draft-model DIR`: stock mlx-lm's speculative decoding with a separate draft
model, one more row of the bench table (issue 20)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.bench.draft import DraftModelBench
from mtpkit.bench.speed import bench
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from tests.checkpoints import CheckpointFactory

runner = CliRunner()


@pytest.fixture(scope="module")
def mimo(checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted MiMo (plain attention: mlx-lm can roll its caches back and speculate)."""
    out = tmp_path_factory.mktemp("mimo") / "mlx"
    return convert(str(checkpoint("mimo")), output=out).output


def test_a_draft_model_is_measured_in_the_same_trials(mimo: Path) -> None:
    # The model drafting for itself: every draft is accepted, so K of every K+1 tokens come
    # from the draft model (mlx-lm's own `from_draft` flags).
    draft = DraftModelBench(mimo, num_draft_tokens=3)
    result = bench(mimo, max_tokens=16, max_depth=1, trials=2, repeats=2, draft=draft)
    run = result.draft_model
    assert run is not None and run.unavailable is None
    assert len(run.decode_tps.values) == len(run.speedup.values) == 2
    assert all(v > 0 for v in run.decode_tps.values)
    assert run.generated == 16 and run.acceptance >= 0.6
    row = result.to_json()["draft_model"]
    assert row["num_draft_tokens"] == 3 and row["speedup"] == run.speedup.median
    # Each speedup is over stock's rate at the run's time: a rate between the stock runs'.
    low, high = min(result.plain_tps.values), max(result.plain_tps.values)
    for rate, speedup in zip(run.decode_tps.values, run.speedup.values, strict=True):
        assert low * 0.999 <= rate / speedup <= high * 1.001


def test_a_model_mlx_lm_cannot_roll_back_gets_the_reason(converted: Path) -> None:
    args = ["bench", "--model", str(converted), "--draft-model", str(converted), "--trials", "1"]
    result = runner.invoke(app, [*args, "--max-tokens", "8", "--depth", "1"])
    assert result.exit_code == 0, result.output
    reason = "mlx-lm cannot speculate on this model: its ArraysCache layers cannot be rolled back"
    assert result.stdout.splitlines()[-1] == f"draft model: {reason}"
    as_json = runner.invoke(app, [*args, "--max-tokens", "8", "--depth", "1", "--json"])
    row = json.loads(as_json.stdout)["draft_model"]
    assert row["unavailable"] == reason and row["decode_tps"] is None


def test_a_draft_model_must_share_the_tokenizer(
    mimo: Path, checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    other = convert(str(checkpoint("mimo", vocab_size=640)), output=tmp_path / "other").output
    result = runner.invoke(
        app, ["bench", "--model", str(mimo), "--draft-model", str(other), "--trials", "1"]
    )
    assert result.exit_code == 1
    assert "must share the model's tokenizer" in result.stderr
