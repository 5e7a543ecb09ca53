"""The command line itself: fixed choices, early range checks, the version."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from typer.testing import CliRunner

from mtpkit import options
from mtpkit.cli import app

runner = CliRunner()


def test_choices_are_the_librarys():
    from mtpkit.decode import MAX_DEPTH
    from mtpkit.plan import LAYOUTS
    from mtpkit.probes import HIDDEN_VARIANTS
    from mtpkit.quant import BITS, DTYPES, GROUP_SIZES
    from mtpkit.runtime import HIDDEN_MODES
    from mtpkit.shapes import DTYPES as SCALE_DTYPES
    from mtpkit.shapes import SHAPES

    assert [d.value for d in options.Dtype] == list(DTYPES)
    assert [int(b.value) for b in options.Bits] == list(BITS)
    assert [int(g.value) for g in options.GroupSize] == list(GROUP_SIZES)
    assert [v.value for v in options.Layout] == list(LAYOUTS)
    assert [h.value for h in options.Hidden] == list(HIDDEN_VARIANTS) == list(HIDDEN_MODES)
    assert [s.value for s in options.RandomShape] == list(SHAPES)
    assert [d.value for d in options.ScaleDtype] == list(SCALE_DTYPES)
    assert options.MAX_DEPTH == MAX_DEPTH


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
from mtpkit.cli import app
runner = CliRunner()
for args in (
    ["bench", "--model", "m", "--trials", "0"],
    ["bench", "--model", "m", "--max-tokens", "0"],
    ["generate", "-m", "m", "-p", "x", "--temp", "-1"],
    ["generate", "-m", "m", "-p", "x", "--top-p", "5"],
    ["generate", "-m", "m", "-p", "x", "--max-tokens", "-5"],
    ["check", "m", "--min-acceptance", "2"],
    ["convert", "m", "-o", "o", "--dtype", "int8"],
):
    result = runner.invoke(app, args)
    print(result.exit_code, "Invalid value" in result.stderr)
result = runner.invoke(app, ["bench", "--model", "m", "--depth", "5"])
print(result.exit_code, result.stderr.strip())
print("mlx.core" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:7] == ["2 True"] * 7
    assert lines[7] == "1 Error: --depth must be between 1 and 4, not 5"
    assert lines[8] == "False"


def test_version_comes_from_the_installed_distribution():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"mtpkit {importlib.metadata.version('mtpkit')}\n"


def test_progress_follows_quiet_and_huggingface_hubs_switch():
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    from mtpkit.output import PROGRESS_GROUP, progress_bar

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
        bar.update(10)
        assert bar.n == 10 and bar.total == 10
        bar.close()
