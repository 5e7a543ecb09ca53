"""What generate, bench and train-head read before MLX does: every safetensors header
validated as inspect validates it (issue 33, 17), a tokenizer that fits the model's vocabulary
(issue 33, 8), a Hub repo that holds a model (issue 32, 6)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from tests import hub_server

runner = CliRunner()
hub = hub_server.hub


def one_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: "), line
    return line


def last_error(result) -> str:
    """The `Error:` line after bench's progress lines (`... loading`)."""
    assert result.exit_code == 1, result.output
    *progress, line = result.stderr.splitlines()
    assert all(p.startswith("... ") for p in progress), progress
    assert line.startswith("Error: ")
    return line


def last_shard(model: Path) -> Path:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    return model / sorted(set(index["weight_map"].values()))[-1]


def rewrite_header(shard: Path, edit) -> None:
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    body = (
        json.dumps(header, separators=(",", ":")).encode().ljust(length)
    )  # same length: the data stays in place
    assert len(body) == length
    shard.write_bytes(data[:8] + body + data[8 + length :])


def overlap(header: dict) -> None:
    """Two tensors of one size made to share one byte range."""
    by_size: dict[int, list[str]] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            by_size.setdefault(entry["data_offsets"][1] - entry["data_offsets"][0], []).append(name)
    first, second = next(names for names in by_size.values() if len(names) > 1)[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])


def dtype_mismatch(header: dict) -> None:
    name = next(n for n in header if n != "__metadata__")
    header[name]["dtype"] = "F32" if header[name]["dtype"] != "F32" else "F16"


def damage(shard: Path, how: str) -> None:
    if how == "overlap":
        rewrite_header(shard, overlap)
    elif how == "dtype":
        rewrite_header(shard, dtype_mismatch)
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "huge length":
        shard.write_bytes(struct.pack("<Q", 2**62) + shard.read_bytes()[8:])
    elif how == "link":
        shard.unlink()
        shard.symlink_to("/etc/passwd")


@pytest.mark.parametrize("how", ["overlap", "dtype", "truncated", "huge length", "link"])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_damaged_raw_shard_is_named_before_loading(checkpoint, tmp_path, how, command):
    """Before: overlapping ranges decoded with exit 0; the others ended in `unexpected
    RuntimeError: [load_safetensors]`. Now: inspect's `corrupt_header`, one line."""
    model = Path(shutil.copytree(checkpoint("qwen3_5"), tmp_path / "raw"))
    shard = last_shard(model)
    damage(shard, how)
    args = {
        "generate": ["generate", "--model", str(model), "-m", "2"],
        "bench": ["bench", "--model", str(model), "-m", "2", "--trials", "1"],
    }[command]
    line = one_error(runner.invoke(app, args))
    assert line.startswith(f"Error: {model} cannot be loaded (corrupt_header): {shard.name}: ")
    assert line.endswith(f"; `mtpkit inspect {model}` lists every problem")


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    """A raw Qwen3.5 checkpoint of vocab_size 300 beside a 512-token tokenizer."""
    from tests.checkpoints import build_checkpoint, write_tokenizer

    model = build_checkpoint("qwen3_5", tmp_path_factory.mktemp("v") / "small", vocab_size=300)
    write_tokenizer(model, 512)
    return model


def test_a_tokenizer_past_the_vocabulary_is_a_problem_everywhere(small_vocab, tmp_path):
    """inspect reports `tokenizer_exceeds_vocab`, convert refuses, generate refuses before
    decoding (before: all passed, and ids past 300 read past the embedding table)."""
    from tests.checkpoints import _tokenizer_json

    top = max(json.loads(_tokenizer_json(512))["model"]["vocab"].values())
    message = (
        f"tokenizer.json in {small_vocab} has ids up to {top} but config.json's "
        "text_config.vocab_size is 300: ids past 299 index past the embedding table; use the "
        "model's own tokenizer files"
    )
    inspected = runner.invoke(app, ["inspect", str(small_vocab), "--json"])
    problems = json.loads(inspected.stdout)["problems"]
    assert {"code": "tokenizer_exceeds_vocab", "message": message} in problems
    out = tmp_path / "out"
    converted = runner.invoke(app, ["convert", str(small_vocab), "-o", str(out)])
    assert "tokenizer_exceeds_vocab" in one_error(converted)
    assert not out.exists()
    generated = runner.invoke(app, ["generate", "--model", str(small_vocab), "-m", "2"])
    assert one_error(generated) == f"Error: {message} (tokenizer_exceeds_vocab)"


@pytest.mark.parametrize("command", ["inspect", "check", "generate", "bench", "train-head"])
def test_a_hub_repo_without_a_model_is_one_clear_line(hub, tmp_path, command):
    """A repo of a README and a script: every command says what inspect says (before:
    generate, bench and train-head ended in `unexpected IndexError`; issue 32, 6)."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "README.md").write_text("# not a model\n")
    (folder / "run.sh").write_text("echo hi\n")
    hub.add_repo("org/not-a-model", folder)
    args = {
        "inspect": ["inspect", "org/not-a-model"],
        "check": ["check", "org/not-a-model"],
        "generate": ["generate", "--model", "org/not-a-model", "-m", "2"],
        "bench": ["bench", "--model", "org/not-a-model", "-m", "2"],
        "train-head": ["train-head", "org/not-a-model", "-o", str(tmp_path / "o")],
    }[command]
    assert one_error(runner.invoke(app, args)) == (
        "Error: org/not-a-model has no config.json: not a model checkpoint (pass the folder "
        "that holds config.json and the safetensors files)"
    )


def nested(config: dict) -> None:
    config["x"] = "NESTED"


def listed(config: dict) -> None:
    config["text_config"] = [config["text_config"]]


COMMANDS = {
    "inspect": lambda m, o: ["inspect", str(m)],
    "convert": lambda m, o: ["convert", str(m), "-o", str(o)],
    "check": lambda m, o: ["check", str(m)],
    "generate": lambda m, o: ["generate", "--model", str(m), "-m", "2"],
    "bench": lambda m, o: ["bench", "--model", str(m), "-m", "2"],
    "train-head": lambda m, o: ["train-head", str(m), "-o", str(o)],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("edit", [nested, listed])
def test_a_config_of_the_wrong_shape_is_one_clear_line(converted, tmp_path, command, edit):
    """A config nested 100,000 deep (before: `unexpected RecursionError`) and a text_config
    given as a list (before: `unexpected AttributeError` in inspect, convert, check,
    train-head), the same line in every command (issue 33, 18)."""
    model = Path(shutil.copytree(converted, tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    edit(config)
    text = json.dumps(config).replace('"NESTED"', '{"a":' * 100_000 + "1" + "}" * 100_000)
    (model / "config.json").write_text(text)
    line = one_error(runner.invoke(app, COMMANDS[command](model, tmp_path / "o")))
    assert (
        line
        == {
            nested: f"Error: config.json in {model} is nested too deeply to read (past Python's "
            "recursion limit): replace it with the original checkpoint's",
            listed: f"Error: config.json in {model}: text_config is a list, not an object "
            "(invalid_config): fix config.json or convert from the original checkpoint",
        }[edit]
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["inspect", "generate"])
def test_hf_endpoint_not_a_url_is_named(command, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "not-a-url")
    line = one_error(runner.invoke(app, COMMANDS[command]("org/repo", Path("o"))))
    assert line == (
        "Error: HF_ENDPOINT='not-a-url' is not an http:// or https:// URL: set it to e.g. "
        "https://huggingface.co, or unset it"
    )


def narrow_llama(path: Path) -> Path:
    """A tiny Llama of hidden size 48 (a multiple of nvfp4's group of 16, not of 32)."""
    import importlib

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from tests.checkpoints import write_tokenizer

    config = {
        "model_type": "llama", "hidden_size": 48, "num_hidden_layers": 2,
        "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 12, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 512,
        "tie_word_embeddings": False, "max_position_embeddings": 2048, "eos_token_id": 2,
    }  # fmt: skip
    arch = importlib.import_module("mlx_lm.models.llama")
    mx.random.seed(5)
    save_model(path, arch.Model(arch.ModelArgs.from_dict(config)))
    save_config(config, path / "config.json")
    write_tokenizer(path, 512)
    return path


def test_nvfp4_on_a_width_mlx_cannot_run_is_refused_at_convert(tmp_path):
    """Before: converted with exit 0, then generate ended in `unexpected ValueError:
    [reshape]` (issue 33, 18). affine -q still converts it, and the result runs."""
    model = narrow_llama(tmp_path / "narrow")
    out = tmp_path / "nv"
    line = one_error(
        runner.invoke(app, ["convert", str(model), "-o", str(out), "--q-mode", "nvfp4"])
    )
    assert line == (
        "Error: --q-mode nvfp4 cannot quantize lm_head (input width 48): MLX runs nvfp4 layers "
        "only on widths that are multiples of 32, so nothing could run the result; use "
        "--q-mode mxfp4 or -q (affine), which leave such layers unquantized"
    )
    assert not out.exists()
    affine = tmp_path / "affine"
    assert runner.invoke(app, ["convert", str(model), "-o", str(affine), "-q"]).exit_code == 0
    ran = runner.invoke(app, ["generate", "--model", str(affine), "-m", "2", "--no-mtp"])
    assert ran.exit_code == 0, ran.output


def test_a_quantized_dir_without_its_quantization_block_is_named(converted, tmp_path):
    """A 4-bit conversion whose config lost `quantization`: inspect reports it, convert
    refuses it and generate names it in one line (before: `unexpected AssertionError`, and
    a 67-line MLX error; issue 33, 16 and 18)."""
    quantized = tmp_path / "q4"
    assert (
        runner.invoke(app, ["convert", str(converted), "-o", str(quantized), "-q"]).exit_code == 0
    )
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization"), config.pop("quantization_config", None)
    (quantized / "config.json").write_text(json.dumps(config))
    problems = json.loads(runner.invoke(app, ["inspect", str(quantized), "--json"]).stdout)[
        "problems"
    ]
    assert [p["code"] for p in problems] == ["invalid_config"]
    assert problems[0]["message"].startswith("config.json has no quantization block but ")
    line = one_error(runner.invoke(app, ["convert", str(quantized), "-o", str(tmp_path / "o")]))
    assert "(invalid_config): config.json has no quantization block" in line
    line = one_error(runner.invoke(app, ["generate", "--model", str(quantized), "-m", "2"]))
    assert line.startswith(f"Error: {quantized}: config.json has no quantization block but ")
    assert line.endswith(
        "restore its quantization block (bits, group_size, mode) from the "
        "conversion, or convert from the original checkpoint (invalid_config)"
    )


def test_bench_draft_model_is_loaded_as_the_model_is(checkpoint, converted, tmp_path):
    """`bench --draft-model` goes through mtpkit's loading: a config-only directory and a
    custom-code tokenizer are one line naming --draft-model, and a raw checkpoint whose head
    mlx-lm does not know loads with the head set aside (before: `unexpected FileNotFoundError`,
    `unexpected ValueError` twice; issue 33, 18)."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(converted / "config.json", config_only / "config.json")
    custom = Path(shutil.copytree(converted, tmp_path / "custom"))
    (custom / "tokenizer.json").unlink()
    tokenizer_config = json.loads((custom / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tok.MyTok", None]}
    tokenizer_config["tokenizer_class"] = "MyTok"
    (custom / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (custom / "tok.py").write_text("class MyTok: pass\n")
    bench = ["bench", "--model", str(converted), "-m", "2", "--trials", "1", "--draft-model"]
    assert last_error(runner.invoke(app, [*bench, str(config_only)])) == (
        f"Error: --draft-model {config_only}: mlx-lm cannot load {config_only}: No safetensors "
        f"found in {config_only}"
    )
    assert last_error(runner.invoke(app, [*bench, str(custom)])).startswith(
        f"Error: --draft-model {custom}: {custom} has no tokenizer files"
    )
    # A raw checkpoint of the target's tokenizer (another family's would now be refused by
    # the tokenizer check, before any decoding).
    target, raw = checkpoint("qwen3_5"), checkpoint("qwen3_5", seed=1)
    result = runner.invoke(
        app,
        ["bench", "--model", str(target), "-m", "2", "--trials", "1", "--draft-model", str(raw)],
    )
    assert result.exit_code == 0, result.output
    assert "draft model: mlx-lm cannot speculate on this model" in result.stdout
