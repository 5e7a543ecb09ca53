"""`mtpkit inspect` against every fixture layout, hostile files and the Hub stand-in.

Expected MTP tensor sets come from `safetensors.safe_open` (another parser) filtered by rules
written out here, and the counts from the family table in MTP_FORMATS.md.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from mtpkit.families import supported
from tests import hub_server
from tests.checkpoints import FAMILIES, RAW_WITH_MTP, build_checkpoint
from tests.hub_server import HubStandIn

hub = hub_server.hub
runner = CliRunner()
LAST = "model-00002-of-00002.safetensors"
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4}


def nextn_rule(root: Path):
    n = json.loads((root / "config.json").read_text())["num_hidden_layers"]
    return lambda k: k.startswith(f"model.layers.{n}.")


def nextn_rule_from(layers: int):
    """Keys of the nextn layers N..N+layers-1 (Step-3.5 keeps several)."""

    def rule(root: Path):
        n = json.loads((root / "config.json").read_text())["num_hidden_layers"]
        return lambda k: any(k.startswith(f"model.layers.{n + i}.") for i in range(layers))

    return rule


# layout -> (rule picking MTP keys, count, expert layout, declared layers, norm convention)
EXPECTED = {
    "qwen3_5": (lambda r: lambda k: k.startswith("mtp."), 15, "dense", 1, "zero_centred"),
    "qwen3_5_moe": (lambda r: lambda k: k.startswith("mtp."), 29, "per_expert", 1, "zero_centred"),
    "qwen3_6_moe": (lambda r: lambda k: k.startswith("mtp."), 19, "fused", 1, "zero_centred"),
    "qwen3_next": (
        lambda r: lambda k: k.startswith("mtp."),
        29,
        "per_expert",
        None,
        "zero_centred",
    ),
    "deepseek_v3": (nextn_rule, 32, "per_expert", 1, "plain"),
    "glm4_moe": (nextn_rule, 34, "per_expert", 1, "plain"),
    "glm4_moe_lite": (nextn_rule, 32, "per_expert", 1, "plain"),
    "deepseek_v32": (nextn_rule, 37, "per_expert", 1, "plain"),
    "glm_moe_dsa": (nextn_rule, 37, "per_expert", 1, "plain"),
    "longcat_flash": (lambda r: lambda k: k.startswith("model.mtp."), 17, "dense", None, "plain"),
    "mimo": (lambda r: lambda k: k.startswith("model.mtp_layers."), 16, "dense", 1, "plain"),
    "ernie4_5_moe": (lambda r: lambda k: k.startswith("model.mtp_"), 12, "dense", 1, "plain"),
    "exaone_moe": (lambda r: lambda k: k.startswith("mtp."), 15, "dense", 1, "plain"),
    "mimo_v2_flash": (lambda r: lambda k: k.startswith("model.mtp."), 42, "dense", None, "plain"),
    "step3p5": (nextn_rule_from(2), 34, "dense", 2, "zero_centred"),
    "nemotron_h": (lambda r: lambda k: k.startswith("mtp."), 24, "per_expert", 1, "plain"),
    "bailing_moe_v3": (nextn_rule, 43, "per_expert", 1, "plain"),
    "bailing_hybrid": (nextn_rule, 42, "per_expert", 1, "plain"),
}


def stored_tensors(root: Path) -> dict[str, tuple[str, list[int], str]]:
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="numpy") as f:
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = (s.get_dtype(), s.get_shape(), shard.name)
    return out


@pytest.fixture(scope="module")
def fixtures(checkpoint) -> dict[str, Path]:
    return {layout: checkpoint(layout) for layout in FAMILIES}


@pytest.mark.parametrize("layout", RAW_WITH_MTP)
def test_raw_layouts_report_the_exact_head(fixtures: dict[str, Path], layout: str) -> None:
    root = fixtures[layout]
    rule, count, experts, declared, norms = EXPECTED[layout]
    stored = stored_tensors(root)
    want = {k: v for k, v in stored.items() if rule(root)(k)}
    result = inspect_checkpoint(str(root))
    mtp = result["mtp"]
    assert result["format"] == "hf"
    assert result["problems"] == []
    assert mtp["present"] is True
    assert mtp["tensor_count"] == count == len(want)
    assert {t["name"] for t in mtp["tensors"]} == set(want)
    for t in mtp["tensors"]:
        dtype, shape, shard = want[t["name"]]
        assert (t["dtype"], t["shape"], t["shard"]) == (dtype, shape, shard)
        assert t["bytes"] == math.prod(shape) * ITEMSIZE[dtype]
    assert mtp["bytes"] == sum(t["bytes"] for t in mtp["tensors"])
    assert mtp["shards"] == [LAST]
    assert mtp["expert_layout"] == experts
    assert mtp["declared_layers"] == declared
    assert mtp["norm_convention"] == norms
    assert mtp["quantized"] is False


@pytest.mark.parametrize("layout", ["deepseek_v3", "glm4_moe"])
def test_nextn_duplicates_are_named_and_not_needed(fixtures: dict[str, Path], layout: str) -> None:
    root = fixtures[layout]
    n = json.loads((root / "config.json").read_text())["num_hidden_layers"]
    mtp = inspect_checkpoint(str(root))["mtp"]
    dups = {t["name"]: t for t in mtp["tensors"] if "duplicate_of" in t}
    assert {k: t["duplicate_of"] for k, t in dups.items()} == {
        f"model.layers.{n}.embed_tokens.weight": "model.embed_tokens.weight",
        f"model.layers.{n}.shared_head.head.weight": "lm_head.weight",
    }
    assert mtp["bytes_needed"] == mtp["bytes"] - sum(t["bytes"] for t in dups.values())
    assert mtp["bytes_needed"] < mtp["bytes"]


def test_stripped_and_mlx_layouts(fixtures: dict[str, Path]) -> None:
    stripped = inspect_checkpoint(str(fixtures["stripped"]))
    assert [p["code"] for p in stripped["problems"]] == ["mtp_declared_not_present"]
    assert stripped["mtp"]["present"] is False and stripped["mtp"]["expert_layout"] is None
    assert stripped["mtp"]["declared_layers"] == 1

    plain = inspect_checkpoint(str(fixtures["mlx_plain"]))
    assert plain["format"] == "mlx"
    assert [p["code"] for p in plain["problems"]] == ["mtp_declared_not_present"]

    inline = inspect_checkpoint(str(fixtures["mlx_inline"]))
    stored = stored_tensors(fixtures["mlx_inline"])
    want = {k for k in stored if k.startswith("language_model.mtp.")}
    assert inline["format"] == "mlx" and inline["problems"] == []
    assert {t["name"] for t in inline["mtp"]["tensors"]} == want
    assert inline["mtp"]["expert_layout"] == "stacked"
    assert inline["mtp"]["quantized"] is True
    assert inline["mtp"]["dtypes"]["U32"] > 0


# ---- hostile and inconsistent checkpoints -------------------------------------------------


def copy_of(fixtures: dict[str, Path], layout: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(fixtures[layout], tmp_path / layout))


def codes(root: Path) -> list[str]:
    return [p["code"] for p in inspect_checkpoint(str(root))["problems"]]


def rewrite_header(shard: Path, edit) -> None:
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_truncated_shard(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5", tmp_path)
    shard = root / LAST
    shard.write_bytes(shard.read_bytes()[:-100])
    assert "corrupt_header" in codes(root)


def test_header_length_claiming_2_to_62(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5", tmp_path)
    shard = root / LAST
    data = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    result = inspect_checkpoint(str(root))
    assert "corrupt_header" in [p["code"] for p in result["problems"]]
    # The head lives in that shard: it is reported missing, not guessed.
    assert result["mtp"]["present"] is False


def test_offsets_past_eof_and_dtype_mismatch(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5", tmp_path)

    def past_eof(h):
        h["mtp.fc.weight"]["data_offsets"][1] += 10**9

    rewrite_header(root / LAST, past_eof)
    assert "corrupt_header" in codes(root)

    root = copy_of(fixtures, "qwen3_5", tmp_path / "b")

    def wrong_dtype(h):
        h["mtp.fc.weight"]["dtype"] = "F32"

    rewrite_header(root / LAST, wrong_dtype)
    assert "corrupt_header" in codes(root)


def test_non_json_header(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5", tmp_path)
    shard = root / LAST
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    shard.write_bytes(data[:8] + b"\xff" * n + data[8 + n :])
    assert "corrupt_header" in codes(root)


def test_unsafe_path_is_never_opened(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5", tmp_path / "repo")
    # A valid safetensors file outside the checkpoint: if it were opened, its tensor would show.
    mx.save_safetensors(str(tmp_path / "outside.safetensors"), {"mtp.evil.weight": mx.zeros((2,))})
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.evil.weight"] = "../outside.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    result = inspect_checkpoint(str(root))
    assert "unsafe_path" in [p["code"] for p in result["problems"]]
    assert "mtp.evil.weight" not in {t["name"] for t in result["mtp"]["tensors"]}


def test_missing_shard_missing_tensor_total_size(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5", tmp_path / "a")
    (root / "model-00001-of-00002.safetensors").unlink()
    assert "missing_shard" in codes(root)

    root = copy_of(fixtures, "qwen3_5", tmp_path / "b")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.ghost.weight"] = LAST
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    assert codes(root) == ["missing_tensor"]

    root = copy_of(fixtures, "qwen3_5", tmp_path / "c")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] += 2
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    assert codes(root) == ["total_size_mismatch"]


def drop_tensors(root: Path, shard: str, names: set[str]) -> None:
    weights = mx.load(str(root / shard))
    kept = {k: v for k, v in weights.items() if k not in names}
    mx.save_safetensors(str(root / shard), kept, metadata={"format": "pt"})
    index = json.loads((root / "model.safetensors.index.json").read_text())
    for k in names:
        del index["weight_map"][k]
    index["metadata"]["total_size"] = sum(
        v.nbytes for s in root.glob("*.safetensors") for v in mx.load(str(s)).values()
    )
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def test_incomplete_experts_and_head(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "qwen3_5_moe", tmp_path / "a")
    drop_tensors(root, LAST, {"mtp.layers.0.mlp.experts.3.up_proj.weight"})
    assert codes(root) == ["incomplete_experts"]

    root = copy_of(fixtures, "qwen3_6_moe", tmp_path / "b")
    drop_tensors(root, LAST, {"mtp.layers.0.mlp.experts.down_proj"})
    assert codes(root) == ["incomplete_experts"]

    root = copy_of(fixtures, "qwen3_5", tmp_path / "c")
    drop_tensors(root, LAST, {"mtp.fc.weight"})
    assert codes(root) == ["incomplete_mtp"]


def test_incomplete_non_gated_experts(fixtures, tmp_path: Path) -> None:
    """Nemotron-H's experts have no gate_proj: a complete set is no problem (the raw
    layout test above), a missing up_proj is, and so is one once stacked (fc1/fc2)."""
    root = copy_of(fixtures, "nemotron_h", tmp_path / "a")
    drop_tensors(root, LAST, {"mtp.layers.1.mixer.experts.2.up_proj.weight"})
    problems = inspect_checkpoint(str(root))["problems"]
    assert [p["code"] for p in problems] == ["incomplete_experts"]
    assert "experts.*.up_proj: 1 of 4 experts missing (first: 2)" in problems[0]["message"]

    out = convert(str(fixtures["nemotron_h"]), output=tmp_path / "mlx").output
    assert inspect_checkpoint(str(out))["problems"] == []
    head = out / "mtp" / "weights.safetensors"
    weights = dict(mx.load(str(head)))
    del weights["mtp.layers.1.mixer.switch_mlp.fc2.weight"]
    mx.save_safetensors(str(head), weights, metadata={"format": "mlx"})
    messages = [p["message"] for p in inspect_checkpoint(str(out))["problems"]]
    assert any("switch_mlp.fc2.weight missing" in m for m in messages), messages


def test_present_not_declared(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "mimo", tmp_path)
    config = json.loads((root / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (root / "config.json").write_text(json.dumps(config))
    assert codes(root) == ["mtp_present_not_declared"]
    # convert repairs it, with the `Warning:` line the README promises
    out = tmp_path / "mlx"
    result = runner.invoke(app, ["convert", str(root), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "Warning: 16 MTP tensors exist but the config does not declare "
        "num_nextn_predict_layers; writing num_nextn_predict_layers=1"
    ]
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


# ---- the command line ------------------------------------------------------------------------


def test_cli_json_and_require_mtp(fixtures) -> None:
    result = runner.invoke(
        app, ["inspect", str(fixtures["qwen3_5_moe"]), "--json", "--require-mtp"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["mtp"]["tensor_count"] == 29

    result = runner.invoke(app, ["inspect", str(fixtures["stripped"]), "--require-mtp"])
    assert result.exit_code == 3
    assert "mtp_declared_not_present" in result.stdout

    result = runner.invoke(app, ["inspect", str(fixtures["stripped"])])
    assert result.exit_code == 0


def test_cli_table(fixtures) -> None:
    result = runner.invoke(app, ["inspect", str(fixtures["deepseek_v3"])], terminal_width=200)
    assert result.exit_code == 0
    lines = [line.rstrip() for line in result.stdout.splitlines()]
    assert "family           deepseek_v3 (model_type deepseek_v3)" in lines
    assert "MTP present      yes" in lines
    assert "expert layout    per_expert" in lines
    assert "no problems found" in lines
    assert not any(line.startswith("Problems") for line in lines)


def test_cli_errors_are_one_line(fixtures, tmp_path: Path) -> None:
    root = copy_of(fixtures, "mimo", tmp_path / "gpt2")
    config = json.loads((root / "config.json").read_text())
    config["model_type"] = "gpt2"
    (root / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["inspect", str(root)])
    assert result.exit_code == 1
    listed = ", ".join(supported())
    assert result.stderr.strip().splitlines() == [
        f"Error: model_type 'gpt2' is not supported; supported: {listed}"
    ]
    assert {"deepseek_v3", "glm4_moe", "mimo", "qwen3_5", "qwen3_next", "kimi_k2"} <= set(
        supported()
    )
    assert "Traceback" not in result.output

    for args, message in [
        ([str(tmp_path / "nope")], "no such directory"),
        ([str(root / "config.json")], "is a file"),
        ([str(tmp_path)], "has no config.json"),
        ([str(root), "--revision", "main"], "--revision applies to Hub repos"),
    ]:
        result = runner.invoke(app, ["inspect", *args])
        assert result.exit_code == 1, args
        assert len(result.stderr.strip().splitlines()) == 1
        assert result.stderr.startswith("Error: ") and message in result.stderr

    (root / "config.json").write_text("{not json")
    result = runner.invoke(app, ["inspect", str(root)])
    assert result.exit_code == 1 and "not valid JSON" in result.stderr


def test_python_m_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mtpkit", "--help"], capture_output=True, text=True, check=True
    )
    assert "inspect" in out.stdout and "Usage" in out.stdout


# ---- the Hub -----------------------------------------------------------------------------------


def test_hub_reads_headers_only(hub: HubStandIn, tmp_path: Path) -> None:
    # A vocabulary this large makes the embedding shards several MB.
    root = build_checkpoint("qwen3_5", tmp_path / "big", vocab_size=65536)
    assert (root / "model-00001-of-00002.safetensors").stat().st_size > 4 * 2**20
    sha = hub.add_repo("org/big", root)
    result = inspect_checkpoint("org/big")
    local = inspect_checkpoint(str(root))
    assert result["mtp"] == local["mtp"] and result["problems"] == local["problems"]
    assert result["commit"] == sha and result["revision"] is None
    for shard in ("model-00001-of-00002.safetensors", LAST):
        assert 0 < hub.bytes_served.get(f"org/big/{shard}", 0) < 256 * 1024
    json_bytes = sum(p.stat().st_size for p in root.glob("*.json"))
    assert hub.total_bytes("org/big") < 2 * 256 * 1024 + json_bytes


def test_hub_revisions_and_errors(hub: HubStandIn, fixtures, tmp_path: Path) -> None:
    sha = hub.add_repo("org/m", fixtures["qwen3_5"])
    hub.add_repo("org/m", fixtures["stripped"], revision="stripped")
    assert inspect_checkpoint("org/m")["mtp"]["present"] is True
    result = inspect_checkpoint("org/m", revision="stripped")
    assert result["revision"] == "stripped" and result["mtp"]["present"] is False
    assert inspect_checkpoint("org/m", revision=sha)["commit"] == sha

    for args, message in [
        (["org/none"], "no Hub repo org/none"),
        (["org/m", "--revision", "v9"], "revision 'v9' not found in org/m"),
    ]:
        result = runner.invoke(app, ["inspect", *args])
        assert result.exit_code == 1, result.output
        assert result.stderr.startswith("Error: ") and message in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_hub_unreachable_and_offline(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    result = runner.invoke(app, ["inspect", "org/model"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ")
    assert "offline" in result.stderr or "cannot reach" in result.stderr
