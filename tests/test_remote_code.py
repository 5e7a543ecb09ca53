"""Never execute or ask about remote code (issue 10, item 4).

MiMo-7B's `config.json` has an `auto_map` and a `model_type` (`mimo`) transformers does not
know; loading its tokenizer without `trust_remote_code=False` makes transformers print
"Do you wish to run the custom code? [y/N]" on stdout and read stdin. Every command must load
it with the library classes, print only its result on stdout and never read stdin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpkit.check.verdict import check_checkpoint
from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.convert.pipeline import convert
from mtpkit.speculative.generate import generate
from tests.checkpoints import CheckpointFactory

AUTO_MAP = {
    "AutoConfig": "configuration_mimo.MiMoConfig",
    "AutoModel": "modeling_mimo.MiMoModel",
    "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
}
# Custom code that must never run: importing it leaves a marker file.
CUSTOM_CODE = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"


class StdinMustNotBeRead:
    def read(self, *args: object) -> str:
        raise AssertionError("standard input was read")

    readline = read

    def isatty(self) -> bool:
        return False


@pytest.fixture(scope="module")
def mimo(checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mimo fixture as MiMo-7B ships: `auto_map` to custom code beside the weights."""
    out = tmp_path_factory.mktemp("remote") / "mimo"
    shutil.copytree(checkpoint("mimo"), out)
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = AUTO_MAP
    (out / "config.json").write_text(json.dumps(config))
    for name in ("configuration_mimo.py", "modeling_mimo.py"):
        (out / name).write_text(CUSTOM_CODE)
    return out


def test_commands_never_read_stdin_nor_print_a_question(
    mimo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(sys, "stdin", StdinMustNotBeRead())
    assert inspect_checkpoint(str(mimo))["family"] == "mimo"
    convert(str(mimo), output=tmp_path / "out")
    result = generate(str(tmp_path / "out"), [5, 6, 7], max_tokens=4, mtp=True)
    assert result.tokens
    report = check_checkpoint(str(mimo), prompts=["The cat sat on"], max_tokens=4)
    assert report["acceptance"] is not None  # the probes loaded model and tokenizer
    assert capsys.readouterr().out == ""
    assert not (mimo / "RAN").exists() and not (tmp_path / "out" / "RAN").exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m mtpkit ARGS` with stdin at end of file, as a CI job runs it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "mtpkit", *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_json_stdout_parses_in_a_subprocess(mimo: Path) -> None:
    proc = run_cli(
        "generate", "--model", str(mimo), "--prompt", "hi", "--max-tokens", "4",
        "--no-chat-template", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["generated_tokens"] > 0
    assert "[y/N]" not in proc.stdout + proc.stderr
    assert not (mimo / "RAN").exists()


def test_a_tokenizer_that_is_only_custom_code_is_one_error_line(mimo: Path, tmp_path: Path) -> None:
    model = shutil.copytree(mimo, tmp_path / "custom-tokenizer")
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "MiMoTokenizer"
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_mimo.MiMoTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (model / "tokenization_mimo.py").write_text(CUSTOM_CODE)
    proc = run_cli("generate", "--model", str(model), "-p", "hi", "--max-tokens", "4", "--json")
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: the tokenizer of ") and "custom code" in lines[-1]
    # --json: stdout holds the error as a JSON object (issue 22), the same message.
    assert json.loads(proc.stdout) == {"error": lines[-1].removeprefix("Error: "), "exit_code": 1}
    assert "Traceback" not in proc.stderr and "[y/N]" not in proc.stderr
    assert not (model / "RAN").exists()
