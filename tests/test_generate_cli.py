"""`mtpkit generate` and `mtpkit bench` on the command line: output, JSON keys, errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "Return a new list of the"
GENERATE_KEYS = {
    "text",
    "tokens",
    "prompt_tokens",
    "generated_tokens",
    "drafted",
    "accepted",
    "acceptance",
    "acceptance_by_depth",
    "decode_tps",
    "prompt_tps",
    "peak_memory_gb",
    "mtp",
    "depth",
    "moe_dtype",
}


@pytest.fixture(scope="module")
def headless(converted: Path) -> Path:
    """The same model without its head (as stock `mlx_lm.convert` would have written it)."""
    out = converted.parent / "tiny-no-head"
    shutil.copytree(converted, out, ignore=shutil.ignore_patterns("mtp"))
    return out


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def test_generate_json_keys_and_values(converted: Path) -> None:
    result = run(
        "generate", "--model", str(converted), "--prompt", PROMPT, "--max-tokens", "24",
        "--mtp", "--depth", "2", "--no-adaptive", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == GENERATE_KEYS
    assert out["mtp"] is True and out["depth"] == 2
    assert out["generated_tokens"] == len(out["tokens"]) <= 24
    assert out["drafted"] >= out["accepted"] > 0
    assert out["acceptance"] == pytest.approx(out["accepted"] / out["drafted"])
    assert len(out["acceptance_by_depth"]) == 2


def test_generate_streams_text_and_summarises_on_stderr(converted: Path) -> None:
    mtp = run("generate", "-m", str(converted), "-p", PROMPT, "--max-tokens", "20", "--mtp")
    plain = run("generate", "-m", str(converted), "-p", PROMPT, "--max-tokens", "20", "--no-mtp")
    assert mtp.exit_code == 0 and plain.exit_code == 0
    assert mtp.stdout == plain.stdout  # greedy: the same text
    assert mtp.stdout.strip()
    assert "acceptance" in mtp.stderr and "MTP depth 1" in mtp.stderr
    assert "no MTP" in plain.stderr


def test_prompt_from_stdin(converted: Path) -> None:
    piped = run(
        "generate", "-m", str(converted), "-p", "-", "--max-tokens", "8", "--json", input=PROMPT
    )
    direct = run("generate", "-m", str(converted), "-p", PROMPT, "--max-tokens", "8", "--json")
    assert json.loads(piped.stdout)["tokens"] == json.loads(direct.stdout)["tokens"]


def test_mtp_without_a_head_is_a_clear_error(headless: Path) -> None:
    result = run("generate", "-m", str(headless), "-p", PROMPT, "--mtp", "--max-tokens", "4")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ")
    assert "mtpkit convert" in result.stderr and "mtpkit inspect" in result.stderr
    assert "Traceback" not in result.output


def test_mtp_auto_without_a_head_warns_and_decodes(headless: Path) -> None:
    for args in (["--mtp", "auto"], []):
        result = run(
            "generate", "-m", str(headless), "-p", PROMPT, "--max-tokens", "4", "--json", *args
        )
        assert result.exit_code == 0, result.output
        assert "Warning: " in result.stderr and "decoding without MTP" in result.stderr
        assert json.loads(result.stdout)["mtp"] is False


def test_prompt_longer_than_the_context(converted: Path, tmp_path: Path) -> None:
    small = tmp_path / "small-context"
    shutil.copytree(converted, small)
    config = json.loads((small / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 6
    (small / "config.json").write_text(json.dumps(config))
    result = run("generate", "-m", str(small), "-p", PROMPT * 3, "--max-tokens", "4")
    assert result.exit_code == 1
    assert "context of 6" in result.stderr and "shorten the prompt" in result.stderr


def test_bad_depth_and_stray_word(converted: Path) -> None:
    result = run("generate", "-m", str(converted), "-p", PROMPT, "--depth", "5")
    assert result.exit_code == 1 and "--depth must be between 1 and 4" in result.stderr
    result = run("generate", "-m", str(converted), "-p", PROMPT, "--mtp", "sometimes")
    assert result.exit_code == 1 and "'auto'" in result.stderr


def test_bench_json(converted: Path) -> None:
    result = run(
        "bench", "--model", str(converted), "--max-tokens", "16", "--depth", "2", "--trials", "2",
        "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    figures = {"plain_tps", "no_mtp_tps", "beta", "delta"}
    assert figures | {f"{k}_range" for k in figures} | {"runs", "adaptive"} <= set(out)
    assert "moe_dtype" in out
    assert [r["depth"] for r in out["runs"]] == [1, 2]
    assert [(r["depth"], r["adaptive"]) for r in out["adaptive"]] == [(1, True)]
    for r in out["runs"]:
        assert {"depth", "acceptance", "decode_tps", "speedup", "ceiling"} <= set(r)
        assert r["decode_tps"] > 0 and r["ceiling"] > 0
        low, high = r["speedup_range"]
        assert low <= r["speedup"] <= high
    assert out["plain_tps"] > 0 and out["beta"] > 0 and out["delta"] > 0
    assert out["trials"] == 2 and set(out["verify_costs"]) == {"2", "3"}
    # bench/bench_table.py turns it into a markdown row with every depth's figures.
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "bench" / "bench_table.py")
    bench_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_table)
    row = bench_table.table([out]).splitlines()[2]
    assert row.startswith(f"| {converted} |") and row.count("x /") == 2


def test_bench_synthetic_acceptance(converted: Path) -> None:
    """`--acceptance`: oracle drafts keep exactly the planned share (seeded per position),
    the JSON says the figures are synthetic, and one stderr line says that 2 trials mean
    little; a value outside [0, 1] is a command-line error."""
    result = run(
        "bench", "--model", str(converted), "--max-tokens", "24", "--depth", "2", "--trials",
        "2", "--acceptance", "0,0.5,1", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["synthetic"] and out["acceptances"] == [0.0, 0.5, 1.0]
    assert out["reliable"] is False and "2 trial(s)" in out["unreliable_because"][0]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "mean little" in warnings[0]
    runs = {(r["depth"], r["synthetic_acceptance"]): r for r in out["runs"]}
    assert runs[(1, 0.0)]["acceptance"] == 0.0 and runs[(2, 1.0)]["acceptance"] == 1.0
    assert 0.2 < runs[(1, 0.5)]["acceptance"] < 0.8
    assert out["stock_token_ms"] > 0 and runs[(1, 1.0)]["step_ms"] > 0
    assert runs[(1, 1.0)]["ceiling_pipelined"] > 0
    # adaptive acceptance is a median of the trials like every other figure
    adaptive = {r["synthetic_acceptance"]: r for r in out["adaptive"]}
    assert adaptive[1.0]["acceptance"] == 1.0 and adaptive[0.0]["acceptance"] == 0.0
    bad = run("bench", "--model", str(converted), "--acceptance", "0,2")
    assert bad.exit_code == 2 and "--acceptance" in bad.stderr
