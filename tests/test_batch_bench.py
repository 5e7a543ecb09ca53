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
    assert report["reliable"] is False  # two trials, as one stream's bench says
    assert report["unreliable_because"][0] == "2 trial(s) (at least 5 for a median to mean much)"
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
    # The warning one stream's bench prints at too few trials, on stderr.
    one_stream = runner.invoke(app, [*base, "--depth", "1"])
    warning = "Warning: these figures mean little: 1 trial(s) (at least 5 for a median to mean much)"
    assert warning in one_stream.stderr and warning in result.stderr
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


def test_batch_rows_continue_from_each_prompt_prefilled_once(converted: Path, monkeypatch) -> None:
    """The batched bench's rows start from each prompt prefilled once (`_Context`): stock's
    from forks of mlx-lm's cache fed only the last token, mtpkit's from prompt-cache entries
    one token shorter. Both decode exactly what stock mlx-lm's `batch_generate` decodes from
    the whole prompts, on a gated-delta-net hybrid, run after run (the forks leave the
    prefilled state as it was)."""
    import importlib

    import mlx_lm

    from mtpkit.bench.batch import _Context, stock_batch_tps
    from mtpkit.bench.prefilled import Prefilled
    from mtpkit.runtime.model import load_model
    from mtpkit.speculative.batch import BatchDecoder

    generate = importlib.import_module("mlx_lm.generate")
    m = load_model(converted)
    model, tokenizer = mlx_lm.load(str(converted))
    monkeypatch.setattr(m.tokenizer, "eos_token_ids", [])
    monkeypatch.setattr(tokenizer, "eos_token_ids", [])
    prompts = [list(range(5, 60)), list(range(100, 140))]
    rows = [prompts[0], prompts[1], prompts[0]]  # width 3: the prompts in turn
    n = 12
    whole = generate.batch_generate(
        model, tokenizer, rows, max_tokens=n, return_token_ids=True
    ).token_ids
    context = _Context(m, model, tokenizer, prompts, [], n, 0, [Prefilled(m, p) for p in prompts])
    assert context.rows(3) == rows
    for depth in (1, 2):
        caches = context.caches(3)
        stock = generate.batch_generate(
            model, tokenizer, [p[-1:] for p in rows], prompt_caches=caches, max_tokens=n,
            return_token_ids=True,
        ).token_ids  # fmt: skip
        assert stock == whole
        decoder = BatchDecoder(m, depth=depth)
        entries = context.entries(3)
        added = [decoder.add(p, max_tokens=n, cached=e) for p, e in zip(rows, entries, strict=True)]
        while decoder.rows:
            decoder.step()
        assert [r.tokens for r in added] == whole
        assert [r.stats.cached_tokens for r in added] == [len(p) - 2 for p in rows]
    assert stock_batch_tps(model, tokenizer, rows, 4, context.caches(3)) > 0


def test_batch_rows_draft_by_prompt_lookup_or_a_draft_model(mimo: Path) -> None:
    """`--batch --prompt-lookup` / `--draft-model DIR`: the rows draft by prompt lookup (each
    row over its own prompt and output) or by the draft model (here the target itself)
    against stock's batching; `--acceptance` (oracle drafts for the head) is refused in one
    line."""
    base = ["bench", "--model", str(mimo), "--batch", "2", "--trials", "1", "--max-tokens", "6"]
    result = runner.invoke(app, [*base, "--prompt-lookup", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["drafter"] == "prompt-lookup" and [w["batch"] for w in report["widths"]] == [2]
    assert report["widths"][0]["mtp"]["prompt-lookup"]["tps"]["median"] > 0
    table = runner.invoke(app, [*base, "--prompt-lookup"])
    assert "prompt-lookup, adaptive" in table.stdout and "MTP (head)" not in table.stdout
    oracle = runner.invoke(app, [*base, "--prompt-lookup", "--acceptance", "0.5"])
    assert oracle.exit_code == 2
    assert "--acceptance replaces the head's drafts" in oracle.stderr
    draft = runner.invoke(app, [*base, "--draft-model", str(mimo), "--json"])
    assert draft.exit_code == 0, draft.output
    report = json.loads(draft.stdout)
    assert report["drafter"] == "draft-model"
    assert report["widths"][0]["mtp"]["draft-model"]["acceptance"] == 1.0  # itself: all kept
    both = runner.invoke(app, [*base, "--draft-model", str(mimo), "--acceptance", "0.5"])
    assert both.exit_code == 2 and "--batch --draft-model takes none" in both.stderr
