"""The validation layer (`mtpkit/checkpoint/validate.py`) as inspect, convert and check use it.

Config values of the wrong type or out of range, a declared MTP layer count that disagrees
with the weights, safetensors headers whose byte ranges overlap or leave gaps (judged against
the safetensors library itself), NaN/Inf in the head, a corrupt shard (reported as corrupt,
not as a missing head), a manifest whose weights file is gone, and a diagnosis whose variant
table and verdict text agree.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from safetensors import safe_open
from typer.testing import CliRunner

from mtpkit.check.probes import Measurement, Variant, diagnose, single_variants
from mtpkit.check.verdict import check_checkpoint
from mtpkit.checkpoint.headers import HeaderError, parse_header
from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from tests.checkpoints import CheckpointFactory

runner = CliRunner()


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    return path


def codes(result: dict[str, Any]) -> list[str]:
    return [p["code"] for p in result["problems"]]


def status(result: dict[str, Any], name: str) -> tuple[str, str]:
    check = next(c for c in result["checks"] if c["name"] == name)
    return check["status"], check["detail"]


# --------------------------------------------------------------------------- config values


def test_a_count_that_is_not_a_number_is_invalid_config(
    checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    path = edit_config(
        copy_of(checkpoint("qwen3_5"), tmp_path / "src"),
        lambda c: c["text_config"].update(mtp_num_hidden_layers="one", hidden_size=-64),
    )
    inspected = inspect_checkpoint(str(path))
    assert codes(inspected) == ["invalid_config", "invalid_config"]
    messages = " ".join(p["message"] for p in inspected["problems"])
    assert "mtp_num_hidden_layers='one' is not an integer" in messages
    assert "hidden_size=-64 must be at least 1" in messages
    result = runner.invoke(app, ["convert", str(path), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert result.stderr.startswith("Error: ") and "(invalid_config)" in result.stderr
    checked = check_checkpoint(str(path), probe=False)
    assert status(checked, "config")[0] == "fail"
    field = next(p["message"] for p in inspected["problems"] if "mtp_num" in p["message"])
    assert status(checked, "head_declared") == ("fail", field)


@pytest.mark.parametrize("declared", [2, -1, 10**9])
def test_declared_layers_must_match_the_weights(
    declared: int, checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    path = edit_config(
        copy_of(checkpoint("deepseek_v3"), tmp_path / "src"),
        lambda c: c.update(num_nextn_predict_layers=declared),
    )
    inspected = inspect_checkpoint(str(path))
    assert codes(inspected) == ["mtp_layer_count_mismatch"]
    assert f"num_nextn_predict_layers={declared}" in inspected["problems"][0]["message"]
    assert "hold 1 MTP layer(s)" in inspected["problems"][0]["message"]
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(path), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "Warning: config declares num_nextn_predict_layers=" in result.stderr
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert inspect_checkpoint(str(out))["problems"] == []
    assert status(check_checkpoint(str(path), probe=False), "head_declared")[0] == "fail"


# --------------------------------------------------------------------------- headers


def write_shard(path: Path, entries: dict[str, tuple[int, int]], data: int) -> Path:
    """A safetensors file of F32 vectors at the given byte ranges over `data` bytes."""
    header = {
        name: {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}
        for name, (begin, end) in entries.items()
    }
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + bytes(data))
    return path


def library_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="numpy") as f:
            list(f.keys())
    except Exception:  # noqa: BLE001 - any refusal is the finding
        return False
    return True


@pytest.mark.parametrize(
    ("entries", "data", "why"),
    [
        ({"a": (0, 16), "b": (8, 24)}, 24, "overlap a's bytes"),
        ({"a": (0, 8), "b": (16, 24)}, 24, "belong to no tensor"),
        ({"a": (8, 16), "b": (16, 24)}, 24, "at the start"),
        ({"a": (0, 8), "b": (8, 16)}, 24, "cover 16 of the 24"),
    ],
)
def test_offsets_that_do_not_tile_the_data_are_corrupt(
    entries: dict[str, tuple[int, int]], data: int, why: str, tmp_path: Path
) -> None:
    path = write_shard(tmp_path / "x.safetensors", entries, data)
    assert not library_accepts(path)  # the independent judge
    with pytest.raises(HeaderError, match=why):
        parse_header("x.safetensors", path.stat().st_size, _reader(path))
    good = write_shard(tmp_path / "good.safetensors", {"a": (0, 8), "b": (8, 24)}, 24)
    assert library_accepts(good)
    parse_header("good.safetensors", good.stat().st_size, _reader(good))


def _reader(path: Path) -> Callable[[int, int], bytes]:
    def read(start: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(length)

    return read


def test_a_corrupt_shard_is_corrupt_not_a_missing_head(
    checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    path = copy_of(checkpoint("qwen3_5"), tmp_path / "src")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = next(s for n, s in index["weight_map"].items() if n.startswith("mtp."))
    data = (path / shard).read_bytes()
    (path / shard).write_bytes(data[: len(data) // 2])  # an interrupted download
    inspected = inspect_checkpoint(str(path))
    assert "corrupt_header" in codes(inspected)
    assert "mtp_declared_not_present" not in codes(inspected)
    assert "incomplete_mtp" not in codes(inspected)
    checked = check_checkpoint(str(path), probe=False)
    state, detail = status(checked, "head_present")
    assert state == "fail" and "cannot be read" in detail and "download" in detail
    assert "--mtp-only" not in detail


# --------------------------------------------------------------------------- head weights


@pytest.fixture(scope="module")
def converted_fixture(checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("validate") / "qwen3_5-mlx"
    convert(str(checkpoint("qwen3_5")), output=out)
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_head_fails_head_finite_before_any_probe(
    bad: float, converted_fixture: Path, tmp_path: Path
) -> None:
    path = copy_of(converted_fixture, tmp_path / "nan")
    head = path / "mtp" / "weights.safetensors"
    weights = dict(mx.load(str(head)))
    name = next(k for k in weights if k.endswith("fc.weight"))
    weights[name] = mx.where(mx.arange(weights[name].size).reshape(weights[name].shape) == 3,
                             mx.array(bad, weights[name].dtype), weights[name])  # fmt: skip
    mx.save_safetensors(str(head), weights, metadata={"format": "mlx"})

    def never(*args: Any, **kwargs: Any) -> float:
        raise AssertionError("a probe ran on a head with NaN/Inf weights")

    checked = check_checkpoint(str(path), measure=never, prompts=["a", "b"])
    state, detail = status(checked, "head_finite")
    assert state == "fail" and detail.startswith(f"head_not_finite: {name} hold")
    assert checked["verdict"] == "fail" and checked["acceptance"] is None
    healthy = check_checkpoint(str(converted_fixture), probe=False)
    assert status(healthy, "head_finite")[0] == "pass"


def test_manifest_fails_when_its_weights_file_is_missing(
    converted_fixture: Path, tmp_path: Path
) -> None:
    path = copy_of(converted_fixture, tmp_path / "no-weights")
    (path / "mtp" / "weights.safetensors").unlink()
    state, detail = status(check_checkpoint(str(path), probe=False), "manifest")
    assert state == "fail" and "mtp/weights.safetensors, which is missing" in detail


# --------------------------------------------------------------------------- the diagnosis

SHIPPED = Variant(0, "post_norm", "embedding_first")


def flat(level: float, seed: int = 0) -> Callable[[Variant], Measurement]:
    """A head no convention moves: every variant at the same level, prompt noise only."""

    def measure_variant(v: Variant) -> Measurement:
        values = []
        for i in range(16):
            difficulty = random.Random(f"{seed}-{i}").uniform(-0.1, 0.1)
            values.append(max(0.0, level + difficulty + random.Random(f"{i}-{v}").gauss(0, 0.03)))
        return Measurement(v, values)

    return measure_variant


def test_a_head_no_convention_moves_is_not_blamed_on_its_norms() -> None:
    # The case: acceptance passes (20.8%) and norms -1 "keeps working", because
    # every variant sits at the same floor; before, check blamed "norms shifted twice".
    for seed in range(10):
        d = diagnose(flat(0.25, seed), SHIPPED)
        assert d.acceptance >= 0.2
        by_name = {c.name: c for c in d.checks}
        assert by_name["norm_shift"].status == "pass", seed
        assert by_name["head_matches_trunk"].status == "fail", seed
        assert "no convention change moves it" in by_name["head_matches_trunk"].detail
        assert d.best.variant == SHIPPED  # best_variant: as shipped, nothing to fix


def test_head_matches_trunk_names_the_variant_best_variant_reports() -> None:
    levels = {"shipped": 0.56, "norm_shift=-1": 0.60, "norm_shift=+1": 0.52, "hidden": 0.61}
    variants = single_variants(SHIPPED)

    def measure_variant(v: Variant) -> Measurement:
        key = next((k for k, known in variants.items() if known == v), "shipped")
        level = levels.get(key, 0.03) if v != SHIPPED else levels["shipped"]
        return Measurement(v, [level + random.Random(f"{i}-{v}").gauss(0, 0.01) for i in range(16)])

    d = diagnose(measure_variant, SHIPPED)
    trunk = next(c for c in d.checks if c.name == "head_matches_trunk")
    assert trunk.status == "pass"
    assert f"({d.best.variant.describe()})" in trunk.detail


def nan_head_source(checkpoint: CheckpointFactory, dst: Path) -> Path:
    """The mimo fixture with NaN in its head's input projection."""
    path = copy_of(checkpoint("mimo"), dst)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.startswith("model.mtp_layers.0.input_proj"))
    shard = path / index["weight_map"][name]
    tensors = dict(mx.load(str(shard)))
    tensors[name] = tensors[name] * mx.array(float("nan"), tensors[name].dtype)
    mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    return path


def test_convert_refuses_a_head_with_nan(checkpoint: CheckpointFactory, tmp_path: Path) -> None:
    path = nan_head_source(checkpoint, tmp_path / "src")
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(path), "-o", str(out), "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "(head_not_finite)" in result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_float16_overflow_is_named_as_such(checkpoint: CheckpointFactory, tmp_path: Path):
    """A bf16 head whose values pass float16's range (65504) becomes Inf when cast: the
    line says so and names the fix, not "download the checkpoint again"."""
    path = copy_of(checkpoint("mimo"), tmp_path / "src")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(n for n in index["weight_map"] if n.startswith("model.mtp_layers.0.input_proj"))
    shard = path / index["weight_map"][name]
    tensors = dict(mx.load(str(shard)))
    tensors[name] = tensors[name] * 1e6
    mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(path), "-o", str(out), "--dtype", "float16", "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {path} cannot be converted to float16: the MTP head's "
        "mtp.layers.0.input_proj.weight holds values past float16's range (65504); pass "
        "--dtype bfloat16 or --dtype float32"
    ]
    assert not out.exists()
    ok = runner.invoke(app, ["convert", str(path), "-o", str(out), "--dtype", "bfloat16", "--quiet"])
    assert ok.exit_code == 0, ok.output


def test_graft_never_installs_a_head_with_nan(checkpoint: CheckpointFactory, tmp_path: Path):
    """Even with --force, a NaN head does not replace a working one (issue: a graft replaced
    a working head by a NaN one); the target stays byte for byte as it was."""
    good = tmp_path / "good"
    assert runner.invoke(app, ["convert", str(checkpoint("mimo")), "-o", str(good), "--quiet"]).exit_code == 0
    before = {p: p.read_bytes() for p in good.rglob("*") if p.is_file()}
    bad = nan_head_source(checkpoint, tmp_path / "bad")
    args = ["convert", str(bad), "--mtp-only", "--into", str(good), "--force", "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "(head_not_finite)" in result.stderr
    assert {p: p.read_bytes() for p in good.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    ("layout", "key"), [("deepseek_v3", "num_hidden_layers"), ("qwen3_5_moe", "num_experts")]
)
def test_a_count_the_tensor_names_depend_on_is_one_error_line(
    layout: str, key: str, checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    def edit(config: dict[str, Any]) -> None:
        (config.get("text_config") or config)[key] = "two"

    path = edit_config(copy_of(checkpoint(layout), tmp_path / "src"), edit)
    junit = tmp_path / "report.xml"
    for args in (["inspect", str(path)], ["check", str(path), "--junit", str(junit)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and result.stdout == ""
        assert result.stderr == f"Error: config.json: {key}='two' is not a non-negative integer " \
            "(invalid_config): fix config.json\n"  # fmt: skip
    assert "invalid_config" in junit.read_text()
