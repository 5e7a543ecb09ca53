"""bench/batch_equal.py: batched greedy rows against their own single stream and stock's.

On the CPU every row equals stock mlx-lm's single stream (the independent reference: its own
`stream_generate` on a load mtpkit never touched); a run given a wrong token is reported as
parting where the token was put, with stock's own margin there."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.stock import stock_tokens

BENCH = Path(__file__).resolve().parents[1] / "bench" / "batch_equal.py"
PROMPTS = ["import os\n", "Numbers from one to ten:", "class Stack:\n"]


def load_tool():
    spec = importlib.util.spec_from_file_location("batch_equal", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_row_equals_stock_on_the_cpu(converted: Path, capsys) -> None:
    """The command itself (`--json`, the serving bench's prompts): every comparison equal,
    each run's tokens as many as stock's, the report's fields there."""
    load_tool().main([str(converted), "--prompts", "3", "--max-tokens", "12", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert {"model", "device", "mlx", "mlx_lm", "max_tokens", "depth", "adaptive", "drafting",
            "comparisons", "prompts", "totals"} <= set(report)  # fmt: skip
    # The head runs drafted (and kept some): their equality is the verify pass's.
    assert all(d["accepted"] > 0 for d in report["drafting"].values())
    assert set(report["drafting"]) == {"mtpkit_single_head", "mtpkit_batch_head"}
    assert report["max_tokens"] == 12 and report["device"] == "cpu"
    assert len(report["comparisons"]) == 7 and len(report["prompts"]) == 3
    for p in report["prompts"]:
        assert set(p["comparisons"]) == set(report["comparisons"])
        assert all(c == {"equal": True, "parts_at": None} for c in p["comparisons"].values())
        assert len(set(p["generated"].values())) == 1 and p["generated"]["stock"] > 0
    assert all(t["equal"] == t["of"] == 3 for t in report["totals"].values())


def test_a_wrong_token_parts_where_it_was_put(converted: Path, capsys) -> None:
    """One token of mtpkit's batched row 1 replaced: both comparisons of that run part at its
    index, with the tokens each chose and stock's top-2 there (stock's own token first);
    the other rows and runs (each row a batch of its own too) stay equal."""
    tool, at = load_tool(), 5

    def wrong(name: str, rows: list[list[int]]) -> list[list[int]]:
        if name != "mtpkit_batch_head":
            return rows
        rows = [list(r) for r in rows]
        rows[1][at] += 1
        return rows

    report = tool.compare(converted, PROMPTS, max_tokens=10, rows_alone=True, perturb=wrong)
    reference = stock_tokens(converted, tool_ids(converted, PROMPTS[1]), 10)
    assert len(reference) > at
    for name in ("mtpkit_batch_head vs stock", "mtpkit_batch_head vs mtpkit_single_head"):
        c = report["prompts"][1]["comparisons"][name]
        assert c["equal"] is False and c["parts_at"] == at
        assert c["tokens"] == [reference[at] + 1, reference[at]]
        assert c["top2"][0] == reference[at] and c["margin"] >= 0 and c["ulp"] > 0
        assert isinstance(c["near_tie"], bool)
        assert report["totals"][name]["equal"] == 2
    untouched = [c for i, p in enumerate(report["prompts"]) for n, c in p["comparisons"].items()
                 if i != 1 or not n.startswith("mtpkit_batch_head")]  # fmt: skip
    assert all(c["equal"] for c in untouched)
    assert len(untouched) == 3 * 9 - 2
    tool.print_report(report)
    lines = capsys.readouterr().out.splitlines()
    assert "[4] mtpkit_batch_head vs stock: 2 of 3 equal (0 of the 1 partings near-ties)" in lines
    assert "[8] mtpkit_batch1_head vs stock: 3 of 3 equal" in lines
    row = next(line.split() for line in lines if line.split()[:1] == ["2"])
    assert row[3:7] == ["=", "=", "=", f"@{at}"]  # [1] to [3] equal, [4] parts at `at`


def tool_ids(path: Path, text: str) -> list[int]:
    import mlx_lm

    return mlx_lm.load(str(path))[1].encode(text)


def test_first_parting_counts_an_early_end() -> None:
    first_parting = load_tool().first_parting
    assert first_parting([1, 2, 3], [1, 2, 3]) is None
    assert first_parting([1, 9, 3], [1, 2, 3]) == 1
    assert first_parting([1, 2], [1, 2, 3]) == 2  # one row ended (an EOS) where the other went on


def test_bad_input_is_one_line(tmp_path: Path, capsys) -> None:
    main = load_tool().main
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    assert e.value.code == f"Error: {tmp_path} is not a model directory (no config.json)"
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--prompts", "0"])
    assert e.value.code == 2
    assert "--prompts and --max-tokens must be at least 1" in capsys.readouterr().err
