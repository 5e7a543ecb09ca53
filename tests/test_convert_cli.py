"""The `mtpkit convert` command line and its recipes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.convert.pipeline import ConvertFlags, resolve_settings
from mtpkit.convert.recipes import all_recipes, find_recipe, load_recipe, recipe_names
from mtpkit.core.errors import MtpkitError
from mtpkit.families import supported
from tests import hub_server
from tests.checkpoints import build_checkpoint

runner = CliRunner()
hub = hub_server.hub


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("mimo", tmp_path_factory.mktemp("src") / "mimo")


def test_convert_then_refusals(mimo, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(mimo), "-o", str(out), "--bits", "4", "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {out}: mimo, ")
    assert (out / "mtp" / "weights.safetensors").exists()

    again = runner.invoke(app, ["convert", str(mimo), "-o", str(out), "--quiet"])
    assert again.exit_code == 1
    assert (
        again.stderr
        == f"Error: {out} already exists: pass --force to replace it, or choose another -o\n"
    )
    assert "Traceback" not in again.output

    requant = runner.invoke(app, ["convert", str(out), "-o", str(tmp_path / "o2"), "--bits", "4"])
    assert requant.exit_code == 1
    assert "is already quantized (4-bit)" in requant.stderr
    assert f"convert from the original checkpoint ({mimo}) instead" in requant.stderr
    assert not (tmp_path / "o2").exists()


def test_bad_flags_are_one_line_errors(mimo, tmp_path):
    # Fixed choices are Click's: listed in --help, anything else a usage error (exit 2).
    choices = [
        (["--bits", "7"], "Invalid value for '--q-bits'", "'7' is not one of '2', '3', '4'"),
        (["--group-size", "48"], "Invalid value for '--q-group-size'", "'32', '64', '128'"),
        (["--q-mode", "int4"], "Invalid value for '--q-mode'", "'affine', 'mxfp4', 'nvfp4'"),
        (["--quant-predicate", "q4_k_m"], "'--quant-predicate'", "'mixed_2_6', 'mixed_3_4'"),
        (["--dtype", "int8"], "Invalid value for '--dtype'", "'int8' is not one of 'bfloat16'"),
        (["--hidden", "mid"], "Invalid value for '--hidden'", "'post_norm', 'pre_norm'"),
        (["--layout", "x"], "Invalid value for '--layout'", "'sidecar', 'inline'"),
    ]
    for flags, *fragments in choices:
        result = runner.invoke(app, ["convert", str(mimo), "-o", str(tmp_path / "x"), *flags])
        assert result.exit_code == 2
        text = " ".join(result.stderr.replace("│", " ").split())
        assert all(f in text for f in fragments), text
    # Contradictions and a missing -o are usage errors too (exit 2), with the usage line.
    cases = [
        (["-o", "x", "--keep-mtp-bf16", "--mtp-bits", "8"], "--keep-mtp-bf16 and --mtp-bits"),
        (["-o", "x", "--q-mode", "mxfp4", "--q-bits", "8"], "mxfp4 takes 4 bits and group"),
        (["-o", "x", "--q-mode", "nvfp4", "--quant-predicate", "mixed_3_6"], "affine"),
        (["-o", "x", "--q-group-size", "32"], "--q-group-size takes effect only when"),
        ([], "Missing option '-o' / '--output'"),
        (["-o", "x", "--into", "y"], "--into DIR grafts a head"),
        (["-o", "x", "--model", "other"], "name the model once"),
    ]
    for flags, message in cases:
        flags = [str(tmp_path / "x") if f == "x" else f for f in flags]
        result = runner.invoke(app, ["convert", str(mimo), *flags])
        lines = result.stderr.splitlines()
        assert result.exit_code == 2, result.output
        assert lines[0].startswith("Usage: ") and lines[-1].startswith("Error: "), lines
        assert message in lines[-1], lines[-1]
        assert not (tmp_path / "x").exists()
    assert not (tmp_path / "x").exists()


def test_stripped_source_exit_1_one_line(tmp_path):
    src = build_checkpoint("stripped", tmp_path / "stripped")
    result = runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert "mtp_declared_not_present" in lines[0]
    assert not (tmp_path / "out").exists()


def test_graft_json(mimo, tmp_path):
    trunk = tmp_path / "trunk"
    first = runner.invoke(app, ["convert", str(mimo), "-o", str(trunk), "--quiet"])
    assert first.exit_code == 0
    graft = ["convert", str(mimo), "--mtp-only", "--into", str(trunk), "--mtp-bits", "8"]
    result = runner.invoke(app, [*graft, "--force", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["family"] == "mimo" and data["head_tensors"] > 0
    assert data["manifest"]["mtp_quantization"] == {"bits": 8, "group_size": 64, "mode": "affine"}
    bad = runner.invoke(
        app, ["convert", str(mimo), "--mtp-only", "--into", str(trunk), "--bits", "4"]
    )
    assert bad.exit_code == 2 and "--mtp-only takes --into DIR" in bad.stderr


def test_every_recipe_loads():
    recipes = all_recipes()
    names = {p.stem for p in recipes}
    for wanted in (
        "qwen3.5-27b",
        "qwen3.5-35b-a3b",
        "qwen3.5-122b-a10b",
        "qwen3.6-27b",
        "qwen3-next-80b-a3b",
        "deepseek-v3",
        "glm-4.5-air",
        "mimo-7b",
        "glm-4.7-flash",
        "deepseek-v3.2",
        "glm-5",
        "longcat-flash-chat",
        "ernie-4.5-21b-a3b",
        "k-exaone-236b-a23b",
        "mimo-v2-flash",
        "step-3.5-flash",
        "nemotron-3-super-120b-a12b",
        "ling-2.6-flash",
        "ring-2.6-1t",
    ):
        assert wanted in names
    for path in recipes:
        recipe = load_recipe(path)
        assert recipe.repo and recipe.family in supported(), path
        assert path.read_text().startswith("#"), f"{path} needs a comment saying why"
        settings, family = resolve_settings(path)
        assert family == recipe.family and settings.bits


def test_flags_override_recipe(tmp_path):
    settings, _ = resolve_settings("qwen3.5-27b", ConvertFlags(bits=8, mtp_bits=4))
    assert settings.bits == 8 and settings.mtp_bits == 4 and not settings.keep_mtp_bf16
    bad = tmp_path / "bad.toml"
    bad.write_text("[convert]\nbitz = 4\n")
    with pytest.raises(MtpkitError, match="unknown \\[convert\\] keys: bitz"):
        resolve_settings(bad)


def test_recipe_family_must_match(mimo, tmp_path):
    result = runner.invoke(
        app, ["convert", str(mimo), "-o", str(tmp_path / "o"), "--recipe", "qwen3.5-27b"]
    )
    assert result.exit_code == 1
    assert "is for qwen3_5 models but" in result.stderr
    ok = runner.invoke(
        app,
        [
            "convert",
            str(mimo),
            "-o",
            str(tmp_path / "m"),
            "--recipe",
            "recipes/mimo-7b.toml",
            "--quiet",
        ],
    )
    assert ok.exit_code == 0, ok.output
    manifest = json.loads((tmp_path / "m" / "mtp" / "manifest.json").read_text())
    assert manifest["backbone_quantization"] == {"bits": 8, "group_size": 64, "mode": "affine"}
    assert manifest["mtp_quantization"] is None


def test_hidden_variant_is_recorded(mimo, tmp_path):
    out = tmp_path / "pre"
    result = runner.invoke(
        app, ["convert", str(mimo), "-o", str(out), "--hidden", "pre_norm", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "mtp" / "manifest.json").read_text())["hidden"] == "pre_norm"
    # Converting again keeps what was recorded unless told otherwise.
    again = runner.invoke(app, ["convert", str(out), "-o", str(tmp_path / "again"), "--quiet"])
    assert again.exit_code == 0, again.output
    manifest = json.loads((tmp_path / "again" / "mtp" / "manifest.json").read_text())
    assert manifest["hidden"] == "pre_norm"
    bad = runner.invoke(app, ["convert", str(mimo), "-o", str(tmp_path / "x"), "--hidden", "mid"])
    assert bad.exit_code == 2 and "Invalid value for '--hidden'" in bad.stderr


def test_module_help_lists_convert():
    result = subprocess.run(
        [sys.executable, "-m", "mtpkit", "convert", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    assert "--mtp-only" in result.stdout and "--keep-mtp-bf16" in result.stdout


def readme_recipe_names() -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "docs" / "REFERENCE.md").read_text()
    start = readme.index("Recipes, each with why:") + len("Recipes, each with why:")
    listed = readme[start : readme.index(".\n", start)]
    return [name.strip() for name in listed.replace("\n", " ").split(",")]


def test_the_readmes_recipe_names_resolve_and_list_every_recipe():
    names = readme_recipe_names()
    found = {find_recipe(name) for name in names}
    assert found == set(all_recipes())  # every name resolves, and every recipe is listed
    assert find_recipe("Qwen/Qwen3.5-27B").stem == "qwen3.5-27b"  # a repo id too


def test_recipe_names_are_in_help_and_in_the_error(tmp_path):
    help_text = " ".join(runner.invoke(app, ["convert", "--help"]).stdout.split())
    for name in recipe_names():
        assert name in help_text.replace("- ", "-"), name
    result = runner.invoke(app, ["convert", "x", "-o", str(tmp_path / "o"), "--recipe", "nope"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: no recipe nope: pass a .toml path or one of {', '.join(recipe_names())}"
    ]


def test_the_package_data_ships_the_recipes():
    """A wheel holds what `[tool.setuptools.package-data]` names: every recipe must match
    (a built wheel was checked to list all of them; building one here would need setuptools
    from the network)."""
    import fnmatch

    from mtpkit.convert.recipes import tomllib  # tomli on Python 3.10

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["mtpkit"]
    package = root / "mtpkit"
    for recipe in all_recipes():
        relative = recipe.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative
    assert (root / "recipes").resolve() == package / "recipes"  # the checkout's recipes/


@pytest.mark.parametrize("flags", [[], ["-q"], ["--q-bits", "3", "--q-group-size", "32"]])
def test_convert_reports_size_and_mlx_lms_bits_per_weight(mimo, tmp_path, flags):
    """Issue 32 item 21: the line names the output's size and the bits per weight that
    mlx-lm's own `compute_bits_per_weight` finds on the loaded model."""
    import re

    import mlx_lm
    from mlx_lm.utils import compute_bits_per_weight

    from mtpkit.cli.output import human_bytes

    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(mimo), "-o", str(out), *flags, "--quiet"])
    assert result.exit_code == 0, result.output
    model, _ = mlx_lm.load(str(out))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    expected = f"{compute_bits_per_weight(model):.3f} bits per weight"
    line = result.stdout.strip()
    assert re.fullmatch(
        rf"wrote {re.escape(str(out))}: mimo, \d+ backbone and \d+ MTP tensors, "
        rf"{re.escape(human_bytes(size))}, {re.escape(expected)}, in [\d.]+s",
        line,
    ), (line, expected)


def test_graft_reports_the_head_it_added_not_a_backbone(mimo, tmp_path):
    trunk = tmp_path / "trunk"
    assert runner.invoke(app, ["convert", str(mimo), "-o", str(trunk), "--quiet"]).exit_code == 0
    graft = ["convert", str(mimo), "--mtp-only", "--into", str(trunk), "--force", "--quiet"]
    result = runner.invoke(app, graft)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("grafted ") and f" MTP tensors into {trunk}: mimo, " in (
        result.stdout
    )
    assert "backbone" not in result.stdout


def _recipe(path: Path, repo: str) -> Path:
    path.write_text(
        f'[model]\nrepo = "{repo}"\nfamily = "qwen3_5"\n\n[convert]\nkeep_mtp_bf16 = true\n'
    )
    return path


def test_a_recipe_without_source_converts_its_model(hub, tmp_path):
    """Issue 32 item 22: `--recipe NAME -o OUT` converts the repo the recipe names."""
    from tests.conftest import EXAMPLE

    hub.add_repo("org/tiny", EXAMPLE)
    recipe = _recipe(tmp_path / "tiny.toml", "org/tiny")
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "--recipe", str(recipe), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"converting org/tiny, the model recipe {recipe} is written for"
    ]
    assert json.loads((out / "mtp" / "manifest.json").read_text())["source"]["spec"] == "org/tiny"


def test_a_recipe_applied_to_another_model_gets_a_note(hub, tmp_path):
    from tests.conftest import EXAMPLE

    hub.add_repo("org/tiny", EXAMPLE)
    other = _recipe(tmp_path / "big.toml", "Qwen/Qwen3.5-27B")
    for i, source in enumerate([str(EXAMPLE), "org/tiny"]):
        out = tmp_path / f"out{i}"
        result = runner.invoke(
            app, ["convert", source, "--recipe", str(other), "-o", str(out), "--quiet"]
        )
        assert result.exit_code == 0, result.output
        assert result.stderr.splitlines() == [
            f"Warning: recipe big was written for Qwen/Qwen3.5-27B, and {source} is another "
            "model: its settings apply as they are"
        ]
    own = _recipe(tmp_path / "own.toml", "org/tiny")
    result = runner.invoke(
        app, ["convert", "org/tiny", "--recipe", str(own), "-o", str(tmp_path / "o"), "--quiet"]
    )
    assert result.exit_code == 0 and result.stderr == ""
EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU backend on Linux")
def test_quantizing_with_bf16_scales_notes_the_cpu_cost(tmp_path):
    """On a machine that runs MLX on its CPU, `convert -q` says once that bfloat16 scales are
    slow there (MLX's CPU quantized matmul) and how to avoid them; float32 scales get no note."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("MLX runs on a GPU here")
    result = runner.invoke(app, ["convert", str(EXAMPLE), "-o", str(tmp_path / "q"), "-q"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "bfloat16 scales" in notes[0], result.stderr
    assert "--dtype float32" in notes[0]
    f32 = ["convert", str(EXAMPLE), "-o", str(tmp_path / "f"), "-q", "--dtype", "float32"]
    result = runner.invoke(app, f32)
    assert result.exit_code == 0, result.output
    assert "note:" not in result.stderr
    plain = runner.invoke(app, ["convert", str(EXAMPLE), "-o", str(tmp_path / "p")])
    assert plain.exit_code == 0 and "note:" not in plain.stderr
