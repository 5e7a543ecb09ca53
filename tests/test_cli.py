"""The command line itself: fixed choices, early range checks, the version."""

from __future__ import annotations

import importlib.metadata
import io
import subprocess
import sys

from typer.testing import CliRunner

from mtpkit.cli import options
from mtpkit.cli.app import app

runner = CliRunner()


def test_bench_choices_are_the_librarys():
    from mtpkit.bench.shapes import DTYPES as SCALE_DTYPES
    from mtpkit.bench.shapes import SHAPES
    from mtpkit.core.choices import MODES, QUANT_PREDICATES
    assert [s.value for s in options.RandomShape] == list(SHAPES)
    assert [d.value for d in options.ScaleDtype] == list(SCALE_DTYPES)
    assert [m.value for m in options.QuantMode] == list(MODES)
    assert [q.value for q in options.QuantPredicate] == list(QUANT_PREDICATES)
    # mlx-lm's own lists: the same choices as mlx_lm.convert offers.
    from mlx_lm.convert import QUANT_RECIPES, configure_parser

    assert list(QUANT_PREDICATES) == QUANT_RECIPES
    assert "--q-mode {" + ",".join(MODES) + "}" in configure_parser().format_help()


def test_help_lists_the_choices():
    text = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "200"}).stdout
    for listed in ("2|3|4|5|6|8", "32|64|128", "bfloat16|float16|float32", "sidecar|inline"):
        assert listed in text
    text = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).stdout
    assert "qwen3_5-0.8b" in text


def test_bad_values_are_usage_errors_before_any_heavy_import():
    # A fresh interpreter: nothing else has imported MLX yet.
    script = """
import sys
from typer.testing import CliRunner
from mtpkit.cli.app import app
runner = CliRunner()
for args in (
    ["bench", "--model", "m", "--trials", "0"],
    ["bench", "--model", "m", "--max-tokens", "0"],
    ["generate", "--model", "m", "-p", "x", "--temp", "-1"],
    ["generate", "--model", "m", "-p", "x", "--temp", "nan"],
    ["generate", "--model", "m", "-p", "x", "--temp", "inf"],
    ["generate", "--model", "m", "-p", "x", "--top-p", "5"],
    ["generate", "--model", "m", "-p", "x", "--max-tokens", "-5"],
    ["check", "m", "--min-acceptance", "2"],
    ["convert", "m", "-o", "o", "--dtype", "int8"],
    ["bench", "--model", "m", "--depth", "5"],
    ["generate", "--model", "m", "--depth", "0"],
    ["train-head", "m", "-o", "o", "--depth", "5"],
):
    result = runner.invoke(app, args)
    lines = result.stderr.splitlines()
    # Click's plain form: usage, a hint, a blank line, one `Error:` line; never a box.
    plain = lines[0].startswith("Usage: ") and lines[1].startswith("Try ") and len(lines) == 4
    print(result.exit_code, lines[-1].startswith("Error: Invalid value for '--") and plain)
print("mlx.core" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:12] == ["2 True"] * 12
    assert lines[12] == "False"


def test_version_comes_from_the_installed_distribution():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"mtpkit {importlib.metadata.version('mtpkit')}\n"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_follows_quiet_the_terminal_and_huggingface_hubs_switch(monkeypatch):
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    from mtpkit.core.console import PROGRESS_GROUP, progress_bar

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a CI log: no bar, no \r frames
    assert progress_bar(10, desc="x") is None
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert progress_bar(10, desc="x", quiet=True) is None
    disable_progress_bars(PROGRESS_GROUP)
    try:
        assert progress_bar(10, desc="x") is None
        assert not are_progress_bars_disabled("huggingface_hub")  # only mtpkit's group
    finally:
        enable_progress_bars(PROGRESS_GROUP)
    bar = progress_bar(10, desc="x")
    if are_progress_bars_disabled():  # HF_HUB_DISABLE_PROGRESS_BARS=1 in this environment
        assert bar is None
    else:
        for _ in range(10):
            bar.update(1)
        bar.close()
        last_frame = terminal.getvalue().split("\r")[-1]
        assert last_frame.startswith("x: 100%") and "10.0/10.0" in last_frame
