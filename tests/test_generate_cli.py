"""`mtpkit generate` and `mtpkit bench` on the command line: output, JSON keys, errors."""

from __future__ import annotations

import importlib.util
import json
import re
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
    "depth_chosen",
    "rounds_by_depth",
    "decode_tps",
    "prompt_tps",
    "peak_memory_gb",
    "mtp",
    "depth",
    "moe_dtype",
    "drafter",
    "finish_reason",
    "generation_tokens",
}


@pytest.fixture(scope="module")
def headless(converted: Path) -> Path:
    """The same model without its head (as stock `mlx_lm.convert` would have written it)."""
    out = converted.parent / "tiny-no-head"
    shutil.copytree(converted, out, ignore=shutil.ignore_patterns("mtp", "mtp.safetensors"))
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
    assert out["depth_chosen"] is False and out["rounds_by_depth"][0] == 0  # every round at 2
    assert out["rounds_by_depth"][1] > 0


def test_generate_chooses_the_depth_without_depth(converted: Path) -> None:
    """Without --depth adaptive drafting chooses each round's depth (1-3, reported with the
    rounds at each); with --no-adaptive every round drafts one token."""
    args = ("generate", "--model", str(converted), "--prompt", PROMPT, "--max-tokens", "24",
            "--mtp", "--json")  # fmt: skip
    out = json.loads(run(*args).stdout)
    assert out["depth"] == 3 and out["depth_chosen"] is True
    assert len(out["rounds_by_depth"]) == 3 and out["rounds_by_depth"][0] >= 1
    plain = json.loads(run(*args, "--no-adaptive").stdout)
    assert plain["depth"] == 1 and plain["depth_chosen"] is False
    assert len(plain["rounds_by_depth"]) == 1 and plain["rounds_by_depth"][0] >= 1
    assert plain["tokens"] == out["tokens"]  # greedy: the model's own text either way


LINES = (
    r"==========\n(?P<text>.+)\n==========\n"
    r"Prompt: \d+ tokens, \d+\.\d{3} tokens-per-sec\n"
    r"Generation: \d+ tokens, (\d+\.\d{3}|n/a) tokens-per-sec\n"
    r"Peak memory: \d+\.\d{3} GB\n"
    r"MTP: (?P<mtp>.+)\n"
)


def test_generate_prints_mlx_lm_generates_lines(converted: Path) -> None:
    """mlx_lm.generate's framing and lines (scripts parse them), plus mtpkit's MTP line."""
    args = ("generate", "--model", str(converted), "-p", PROMPT, "-m", "20")
    mtp, plain = run(*args, "--mtp"), run(*args, "--no-mtp")
    assert mtp.exit_code == 0 and plain.exit_code == 0
    a, b = re.fullmatch(LINES, mtp.stdout, re.S), re.fullmatch(LINES, plain.stdout, re.S)
    assert a and b, (mtp.stdout, plain.stdout)
    assert a["text"] == b["text"] and a["text"].strip()  # greedy: the same text
    chosen = r"depth 1-3 \(rounds at each: \d+/\d+/\d+\)"  # adaptive drafting's choices
    assert re.fullmatch(chosen + r", acceptance \d+\.\d% \(\d+/\d+\)", a["mtp"])
    assert b["mtp"] == "MTP: off (plain decoding)".removeprefix("MTP: ")
    assert mtp.stderr == plain.stderr == ""
    quiet = run(*args, "--mtp", "--verbose", "False")
    assert quiet.stdout == a["text"] + "\n"  # mlx-lm's --verbose False: the text only


def test_prompt_from_stdin(converted: Path) -> None:
    piped = run(
        "generate",
        "--model",
        str(converted),
        "-p",
        "-",
        "--max-tokens",
        "8",
        "--json",
        input=PROMPT,
    )
    direct = run("generate", "--model", str(converted), "-p", PROMPT, "--max-tokens", "8", "--json")
    assert json.loads(piped.stdout)["tokens"] == json.loads(direct.stdout)["tokens"]


def test_mtp_without_a_head_is_a_clear_error(headless: Path) -> None:
    result = run("generate", "--model", str(headless), "-p", PROMPT, "--mtp", "--max-tokens", "4")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ")
    assert "mtpkit convert" in result.stderr and "mtpkit inspect" in result.stderr
    assert "Traceback" not in result.output


def test_mtp_auto_without_a_head_warns_and_decodes(headless: Path) -> None:
    for args in (["--mtp", "auto"], []):
        result = run(
            "generate", "--model", str(headless), "-p", PROMPT, "--max-tokens", "4", "--json", *args
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
    result = run("generate", "--model", str(small), "-p", PROMPT * 3, "--max-tokens", "4")
    assert result.exit_code == 1
    assert "context of 6" in result.stderr and "shorten the prompt" in result.stderr


def test_bad_command_lines_are_usage_errors(converted: Path) -> None:
    """Exit 2 with Click's usage line, which names no hidden [auto] argument."""
    cases = [
        (["--depth", "5"], "Invalid value for '--depth'"),
        (["--mtp", "sometimes"], "Got unexpected extra argument (sometimes)"),
        (["auto"], "Got unexpected extra argument (auto) (only `--mtp auto` takes a word)"),
        (["--no-mtp", "--depth", "3"], "--depth drafts with the head: it contradicts --no-mtp"),
        (["--no-mtp", "--hidden", "pre_norm"], "--hidden feeds the head: it contradicts"),
        (["--verbose", "maybe"], "'maybe' is not True or False"),
    ]
    for args, message in cases:
        result = run("generate", "--model", str(converted), "-p", PROMPT, *args)
        lines = result.stderr.splitlines()
        assert result.exit_code == 2, result.output
        assert lines[0] == "Usage: mtpkit generate [OPTIONS]" or lines[0].endswith(
            "generate [OPTIONS]"
        ), lines[0]
        assert message in lines[-1], lines[-1]
    assert "[auto]" not in run("generate", "-h").stdout


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
    assert [(r["depth"], r["adaptive"]) for r in out["adaptive"]] == [(3, True)]  # 1-3 chosen
    assert len(out["adaptive"][0]["rounds_by_depth"]) == 3
    for r in out["runs"]:
        assert {"depth", "acceptance", "decode_tps", "speedup", "ceiling"} <= set(r)
        assert r["looked_ahead"] == r["launched_ahead"] == r["discarded"] == 0  # a CPU: serial
        assert r["decode_tps"] > 0 and r["ceiling"] > 0
        low, high = r["speedup_range"]
        assert low <= r["speedup"] <= high
    assert out["plain_tps"] > 0 and out["beta"] > 0 and out["delta"] > 0
    assert out["trials"] == 2 and set(out["verify_costs"]) == {"2", "3"}
    assert out["matmul_routes"] == {}  # the multi-row matmul is routed on CUDA only
    assert out["device"] in ("cpu", "gpu")  # a word, not the repr Device(cpu, 0)
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
    warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 1 and "mean little" in warnings[0]
    runs = {(r["depth"], r["synthetic_acceptance"]): r for r in out["runs"]}
    assert runs[(1, 0.0)]["acceptance"] == 0.0 and runs[(2, 1.0)]["acceptance"] == 1.0
    assert 0.2 < runs[(1, 0.5)]["acceptance"] < 0.8
    assert out["stock_token_ms"] > 0 and runs[(1, 1.0)]["step_ms"] > 0
    assert runs[(1, 1.0)]["ceiling_pipelined"] > 0
    # 10 runs a trial: stock opens it, runs after the 4th and 8th and closes it; the two
    # inner ones of each trial read against their neighbours give stock over itself.
    low, high = out["stock_self_range"]
    assert 0 < low <= out["stock_self"] <= high
    # adaptive acceptance is a median of the trials like every other figure
    adaptive = {r["synthetic_acceptance"]: r for r in out["adaptive"]}
    assert adaptive[1.0]["acceptance"] == 1.0 and adaptive[0.0]["acceptance"] == 0.0
    bad = run("bench", "--model", str(converted), "--acceptance", "0,2")
    assert bad.exit_code == 2 and "--acceptance" in bad.stderr
