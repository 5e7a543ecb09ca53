"""A chat template from a checkpoint runs bounded in time and size in every command that
applies one (issue 33, 13), and its own error reaches the terminal escaped (issue 33, 15)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mtpkit.core.templates
from mtpkit.cli.app import app
from mtpkit.core.templates import FIX

runner = CliRunner()
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
HUGE = "{{ 'A' * 3000000000 }}"


def with_template(converted: Path, directory: Path, template: str) -> Path:
    model = Path(shutil.copytree(converted, directory))
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    return model


def command(name: str, model: Path, tmp_path: Path) -> list[str]:
    return {
        "generate": ["generate", "--model", str(model), "-m", "2"],
        "check": ["check", str(model)],
        "bench": ["bench", "--model", str(model), "-m", "2", "--trials", "1"],
        "train-head": ["train-head", str(model), "-o", str(tmp_path / "o"), "--steps", "1",
                       "--batch-size", "1", "--quiet"],
    }[name]  # fmt: skip


@pytest.mark.parametrize("name", ["generate", "check", "bench", "train-head"])
def test_a_template_that_loops_for_hours_is_stopped(converted, tmp_path, monkeypatch, name):
    """Two nested range(100000) loops: stopped at the time bound (1 s here, MAX_SECONDS in
    use), one line; before, the command hung."""
    monkeypatch.setattr(mtpkit.core.templates, "MAX_SECONDS", 1.0)
    model = with_template(converted, tmp_path / "m", LOOPS)
    result = runner.invoke(app, command(name, model, tmp_path))
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        f"Error: the tokenizer's chat template ran longer than 1 seconds: it is not run "
        f"further; {FIX}"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["generate", "train-head"])
def test_a_template_that_builds_gigabytes_is_stopped(converted, tmp_path, name):
    """`'A' * 3000000000` is refused before it is built (before: 3 GB allocated)."""
    model = with_template(converted, tmp_path / "m", HUGE)
    result = runner.invoke(app, command(name, model, tmp_path))
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        "Error: the tokenizer's chat template builds a value of 3,000,000,000 items: it is not "
        f"run further; {FIX}"
    )


def test_a_templates_own_error_is_one_escaped_line(converted, tmp_path):
    model = with_template(
        converted, tmp_path / "m", "{{ raise_exception('roles must alternate\x1b]0;x\x07') }}"
    )
    result = runner.invoke(app, command("generate", model, tmp_path))
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines() == [
        "Error: the tokenizer's chat template refused the prompt (TemplateError: roles must "
        f"alternate\\x1b]0;x\\x07); {FIX}"
    ]


def test_a_real_template_renders_as_transformers_renders_it(converted, tmp_path):
    """The bounded trial changes nothing: the tokens are transformers' own."""
    from mlx_lm import load

    from mtpkit.core.prompts import encode_prompt

    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    model = with_template(converted, tmp_path / "m", template)
    _, tokenizer = load(str(model))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True
    )
    assert encode_prompt(tokenizer, "hi") == list(expected)
