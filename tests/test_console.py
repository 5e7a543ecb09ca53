"""The console layer: what reaches a terminal is printable text (control characters from a
file escaped), every error is one bounded line, a closed pipe ends quietly, warnings have one
habit, and piped tables wrap rather than grow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.core.console import PIPE_WIDTH, printable
from mtpkit.core.errors import MAX_MESSAGE, MtpkitError, one_line
from tests.checkpoints import add_tensor

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
# A window-title sequence, a bell and a clear-screen: what a hostile name would send.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J"
ESCAPED = "\\x1b]0;pwned\\x07\\x1b[2J"


def assert_printable(text: str) -> None:
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) <= 0x9F for c in text), text


def test_printable_escapes_what_a_terminal_would_act_on():
    assert printable(f"a{HOSTILE}b\x9b\u202e\tc\nd") == f"a{ESCAPED}b\\x9b\\u202e\tc\nd"
    assert printable("model.layers.0.weight") == "model.layers.0.weight"


@pytest.fixture(scope="module")
def hostile(checkpoint, tmp_path_factory) -> Path:
    """A raw Qwen3.5 checkpoint with an MTP tensor whose name carries terminal sequences."""
    path = Path(shutil.copytree(checkpoint("qwen3_5"), tmp_path_factory.mktemp("h") / "hostile"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    add_tensor(path, shard, f"mtp.layers.0.{HOSTILE}x.weight", mx.zeros((4,), dtype=mx.bfloat16))
    return path


@pytest.mark.parametrize("command", ["inspect", "check", "convert", "generate"])
def test_names_from_a_checkpoint_reach_the_terminal_escaped(hostile, tmp_path, command):
    args = {
        "inspect": ["inspect", str(hostile)],
        "check": ["check", str(hostile)],
        "convert": ["convert", str(hostile), "-o", str(tmp_path / "out")],
        "generate": ["generate", "--model", str(hostile), "-m", "2"],
    }[command]
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 1, 3), result.output
    assert_printable(result.stdout + result.stderr)
    assert ESCAPED in result.stdout + result.stderr


def test_a_model_type_from_a_config_is_escaped_in_the_error(checkpoint, tmp_path):
    path = Path(shutil.copytree(checkpoint("qwen3_5"), tmp_path / "m"))
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = config["text_config"]["model_type"] = f"evil{HOSTILE}"
    (path / "config.json").write_text(json.dumps(config))
    for args in (["inspect", str(path)], ["generate", "--model", str(path)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1, result.output
        [line] = result.stderr.splitlines()
        assert f"evil{ESCAPED}" in line
        assert_printable(result.stderr)


def test_an_error_quoting_a_multi_line_library_message_is_one_line(converted, tmp_path):
    """A head missing a tensor: MLX's `Missing 1 parameters: \\nfc.weight.` is quoted whole,
    on the same line (issue 32, 14)."""
    model = Path(shutil.copytree(converted, tmp_path / "m"))
    weights = model / "mtp" / "weights.safetensors"
    tensors = mx.load(str(weights))
    del tensors[next(k for k in sorted(tensors) if k.endswith("fc.weight"))]
    mx.save_safetensors(str(weights), tensors)
    result = runner.invoke(app, ["generate", "--model", str(model), "--mtp", "-m", "2"])
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        f"Error: the MTP head in {model} does not fit this model (Missing 1 parameters: "
        "fc.weight.): graft the model's own head with `mtpkit convert ORIGINAL --mtp-only "
        "--into DIR`"
    ]


def test_an_error_of_many_lines_is_one_bounded_line(converted, tmp_path):
    """A head of 3,000 junk tensors: MLX names each on its own line; the error is one line of
    at most MAX_MESSAGE characters and says how much it left out (issue 33, 16)."""
    model = Path(shutil.copytree(converted, tmp_path / "m"))
    weights = model / "mtp" / "weights.safetensors"
    tensors = mx.load(str(weights))
    prefix = next(iter(tensors)).split("mtp.")[0] + "mtp."
    tensors.update({f"{prefix}junk.{i}.weight": mx.zeros((1,)) for i in range(3000)})
    mx.save_safetensors(str(weights), tensors)
    result = runner.invoke(app, ["generate", "--model", str(model), "--mtp", "-m", "2"])
    assert result.exit_code == 1, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: ") and len(line) < MAX_MESSAGE + 100
    assert line.endswith("characters; MTPKIT_DEBUG=1 shows all)")


def test_one_line_bounds_and_flattens_every_message():
    long = MtpkitError("first\nsecond\r\nthird" + " x" * 5000)
    text = one_line(long)
    assert "\n" not in text and "\r" not in text and text.startswith("first second third x")
    assert len(text) <= MAX_MESSAGE + 60
    unexpected = one_line(RuntimeError(f"bad {HOSTILE}\nmore"))
    assert unexpected == f"unexpected RuntimeError: bad {ESCAPED} (MTPKIT_DEBUG=1 shows where)"


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{model}"],
        ["generate", "--model", "{model}", "-m", "8", "--no-chat-template"],
    ],
)
def test_a_closed_pipe_ends_quietly_as_unix_tools_do(converted, args):
    """`mtpkit ... | head -1` after head has gone: no message, and SIGPIPE's shell code 141
    (issue 32, 7); the reader is gone before the first write, so the write always fails."""
    read, write = os.pipe()
    os.close(read)
    command = [sys.executable, "-m", "mtpkit", *(a.format(model=converted) for a in args)]
    proc = subprocess.run(command, stdout=write, stderr=subprocess.PIPE, cwd=ROOT, timeout=600)
    os.close(write)
    assert proc.stderr.decode() == ""
    assert proc.returncode == 141


def test_tables_on_a_pipe_wrap_long_cells(converted, monkeypatch):
    """The "Runs in" notes are long; on a pipe they wrap within PIPE_WIDTH columns, whole
    (issue 32, 20)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    result = runner.invoke(app, ["inspect", str(converted)])
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= PIPE_WIDTH
    assert "…" not in result.stdout
    assert "python -m" in result.stdout and "mlx_vlm.split_mtp" in result.stdout


def test_warnings_have_one_habit(converted, tmp_path):
    """`Warning: ...` everywhere, as mlx-lm's tuner and Click's `Error:` capitalise it."""
    result = runner.invoke(
        app, ["convert", str(converted), "-o", str(tmp_path / "o"), "--keep-mtp-bf16"]
    )
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("Warning: nothing is quantized without -q")


def test_a_shard_name_from_the_index_is_escaped(checkpoint, tmp_path):
    path = Path(shutil.copytree(checkpoint("qwen3_5"), tmp_path / "m"))
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name] = f"model{HOSTILE}.safetensors"
    index_file.write_text(json.dumps(index))
    result = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "400"})
    assert_printable(result.stdout + result.stderr)
    assert f"model{ESCAPED}.safetensors" in result.stdout
