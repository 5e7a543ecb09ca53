"""Every Python snippet of the README (and of docs/REFERENCE.md's batched API) runs as written,
in order, in one namespace, in a directory holding the converted example as `tiny-mlx`, as the
fresh-machine commands leave it; and the fresh-machine commands are the two `.ci/run` reads."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(name: str) -> list[str]:
    return BLOCK.findall((ROOT / name).read_text())


@pytest.mark.parametrize("name", ["README.md", "docs/REFERENCE.md"])
def test_every_python_snippet_runs_as_written(name, converted, tmp_path, monkeypatch) -> None:
    blocks = snippets(name)
    assert blocks
    (tmp_path / "tiny-mlx").symlink_to(converted)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for i, block in enumerate(blocks):
            exec(compile(block, f"{name} python block {i + 1}", "exec"), namespace)  # noqa: S102
    assert out.getvalue().strip()
    if name == "README.md":
        assert "Prompt:" in out.getvalue() and "MTP: mtp, acceptance" in out.getvalue()


def test_the_fresh_machine_commands_stay_as_ci_reads_them() -> None:
    text = (ROOT / "README.md").read_text()
    fenced = text.split("<!-- fresh-machine -->")[1].split("<!-- /fresh-machine -->")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", fenced, re.S)
    assert commands == [
        'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/mtpkit '
        "convert mtpkit/examples/tiny-qwen3_5 -o tiny-mlx --force && .venv/bin/mtpkit generate "
        '--model tiny-mlx --mtp --prompt "Create a new event loop. You" --max-tokens 64 '
        "--no-chat-template",
        ".venv/bin/python -m pytest",
    ]
    assert os.path.exists(ROOT / "mtpkit/examples/tiny-qwen3_5")
