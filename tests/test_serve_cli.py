"""`mtpkit serve` on the command line: mlx_lm.server's flags with their defaults, and the
errors a user can make before anything is served."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app

# mlx_lm.server's flags (mlx_lm/server.py, 0.32) with its defaults, and mtpkit's own.
MLX_LM_SERVER_DEFAULTS = {
    "--host": "127.0.0.1",
    "--port": "8080",
    "--temp": "0.0",
    "--top-p": "1.0",
    "--top-k": "0",
    "--min-p": "0.0",
    "--max-tokens": "512",
    "--prompt-cache-size": "10",
    "--log-level": "INFO",
    "--chat-template-args": "{}",
}
FLAGS = [
    "--model", "--draft-model", "--num-draft-tokens", "--chat-template", "--trust-remote-code",
    "--allowed-origins", "--depth", "--no-mtp", "--prompt-lookup", "--api-key",
    "--allow-model-paths", "--queue-size", "--max-kv-size", "--decode-concurrency",
    "--served-model-name", "--adapter-path", "--prefill-step-size", "--use-default-chat-template",
]  # fmt: skip
# mlx_lm.server's flags mtpkit serve cannot honour: each a usage error saying why.
UNSERVED = {
    "--prompt-concurrency": (["4"], "prefills one prompt at a time"),
    "--prompt-cache-bytes": (["1G"], "bounded by entries (--prompt-cache-size)"),
    "--kv-bits": (["4"], "a quantized KV cache cannot be rolled back"),
    "--kv-group-size": (["32"], "a quantized KV cache cannot be rolled back"),
    "--quantized-kv-start": (["100"], "a quantized KV cache cannot be rolled back"),
    "--pipeline": ([], "runs on one machine"),
}


def run(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


def test_help_lists_mlx_lm_server_flags_with_their_defaults() -> None:
    result = run("--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for flag in FLAGS:
        assert flag in text
    for flag, default in MLX_LM_SERVER_DEFAULTS.items():
        assert re.search(re.escape(flag) + r"\b.*?\[default: " + re.escape(default), text), flag


def test_a_taken_port_is_one_error_line(converted: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run("--model", str(converted), "--port", str(port))
    assert result.exit_code == 1
    assert f"Error: cannot listen on 127.0.0.1:{port}" in result.output
    assert "Traceback" not in result.output


def test_a_missing_model_is_one_error_line(tmp_path: Path) -> None:
    result = run("--model", str(tmp_path / "nothing"), "--port", "0")
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("Error: ")
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["--chat-template-args", "not json"],
        ["--chat-template-args", "[1]"],
        ["--no-mtp", "--depth", "2"],
        ["--draft-model", "x", "--prompt-lookup"],
        ["--port", "70000"],
        ["--log-level", "LOUD"],
        ["--queue-size", "0"],
        ["--decode-concurrency", "0"],
    ],
)
def test_usage_errors_exit_2(args: list[str], tmp_path: Path) -> None:
    result = run("--model", str(tmp_path), *args)
    assert result.exit_code == 2, result.output


@pytest.mark.parametrize("flag", list(UNSERVED))
def test_mlx_lm_server_flags_it_cannot_honour_say_why(flag: str, tmp_path: Path) -> None:
    value, why = UNSERVED[flag]
    result = run("--model", str(tmp_path), flag, *value)
    assert result.exit_code == 2, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and f"{flag} is mlx_lm.server's and not served" in error[0]
    assert why in error[0] and "Traceback" not in result.output
