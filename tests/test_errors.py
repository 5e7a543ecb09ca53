"""Every failure is one `Error:` line, exit 1 (usage errors: Click's plain form, exit 2)."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.core.errors import MtpkitError, one_line

runner = CliRunner()


def with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def word_count(checkpoint, tmp_path_factory) -> Path:
    """A Qwen3.5 checkpoint whose config says `"mtp_num_hidden_layers": "one"`."""

    def edit(config):
        config["text_config"]["mtp_num_hidden_layers"] = "one"

    return with_config(checkpoint("qwen3_5"), tmp_path_factory.mktemp("cfg") / "one", edit)


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), lines
    return lines[0]


@pytest.fixture
def faulty_reader(monkeypatch):
    """A fault nobody foresaw: reading any safetensors header raises a bare RuntimeError."""
    import mtpkit.checkpoint.inspect

    def broken(*args, **kwargs):
        raise RuntimeError("simulated fault\nsecond line")

    monkeypatch.setattr(mtpkit.checkpoint.inspect, "parse_header", broken)


@pytest.mark.parametrize("command", ["inspect", "convert", "check"])
def test_an_unexpected_exception_is_one_line(checkpoint, faulty_reader, tmp_path, command):
    source = checkpoint("qwen3_5")
    args = {
        "inspect": ["inspect", str(source)],
        "convert": ["convert", str(source), "-o", str(tmp_path / "out")],
        "check": ["check", str(source), "--junit", str(tmp_path / "r.xml"), "--json"],
    }[command]
    line = one_error_line(runner.invoke(app, args))
    assert line == "Error: unexpected RuntimeError: simulated fault (MTPKIT_DEBUG=1 shows where)"
    assert not (tmp_path / "out").exists()
    if command == "check":
        case = ET.parse(tmp_path / "r.xml").getroot().find("testsuite/testcase")
        error = case.find("error")
        assert case.get("name") == "check" and error.get("type") == "RuntimeError"
        assert error.get("message") == line.removeprefix("Error: ")


def test_a_word_for_a_layer_count_is_a_named_problem_not_a_traceback(word_count):
    result = runner.invoke(app, ["inspect", str(word_count), "--json"])
    assert result.exit_code == 0 and "Traceback" not in result.output
    codes = {p["code"] for p in json.loads(result.stdout)["problems"]}
    assert "invalid_config" in codes


def test_mtpkit_debug_shows_the_traceback(checkpoint, faulty_reader):
    result = runner.invoke(app, ["inspect", str(checkpoint("qwen3_5"))], env={"MTPKIT_DEBUG": "1"})
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)


def test_one_line_keeps_a_user_error_as_it_is():
    assert one_line(MtpkitError("no such thing: do this")) == "no such thing: do this"
    assert one_line(KeyError("k")) == "unexpected KeyError: 'k' (MTPKIT_DEBUG=1 shows where)"
    assert (
        one_line(RuntimeError("a\nb")) == "unexpected RuntimeError: a (MTPKIT_DEBUG=1 shows where)"
    )


def test_paths_that_exist_nowhere(tmp_path, monkeypatch):
    line = one_error_line(runner.invoke(app, ["inspect", "models/Qwen3.5-été"]))
    assert (
        line
        == "Error: no such directory models/Qwen3.5-été, and it is not a Hub repo id "
        "(name or org/name)"
    )
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    line = one_error_line(runner.invoke(app, ["inspect", "models/Qwen3.5"]))
    assert line.startswith(
        "Error: models/Qwen3.5 is neither a local directory nor reachable on the Hub: offline"
    )


def test_a_directory_without_config_is_refused_before_it_is_walked(tmp_path, monkeypatch):
    import mtpkit.checkpoint.source

    (tmp_path / "a" / "b").mkdir(parents=True)

    def walked(*args, **kwargs):
        raise AssertionError("the directory was listed")

    monkeypatch.setattr(mtpkit.checkpoint.source.LocalSource, "__init__", walked)
    line = one_error_line(runner.invoke(app, ["inspect", str(tmp_path)]))
    assert line.startswith(f"Error: {tmp_path} has no config.json: not a model checkpoint")


def test_a_config_without_model_type(checkpoint, tmp_path):
    def drop(config):
        del config["model_type"]  # text_config still names the family

    src = with_config(checkpoint("qwen3_5"), tmp_path / "src", drop)
    result = runner.invoke(app, ["inspect", str(src), "--json"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["model_type"] is None
    assert [p["code"] for p in report["problems"]] == ["missing_model_type"]
    line = one_error_line(runner.invoke(app, ["convert", str(src), "-o", str(tmp_path / "o")]))
    assert line.startswith(f"Error: {src} cannot be converted (missing_model_type): config.json")
    assert not (tmp_path / "o").exists()

    def drop_all(config):
        del config["model_type"], config["text_config"]["model_type"]

    bare = with_config(checkpoint("qwen3_5"), tmp_path / "bare", drop_all)
    line = one_error_line(runner.invoke(app, ["inspect", str(bare)]))
    assert line.startswith("Error: config.json has no model_type, so its model family is unknown")
