"""`inspect` recognises the head layouts of mtpkit and of the peers, and says which MLX runtimes
a directory will run in (issue 20). The rows follow what running each peer showed
(`scripts/run_peers.py`, `tests/test_mlx_vlm.py`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.convert.pipeline import convert

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


def _runs(report: dict) -> dict[str, tuple[bool, bool]]:
    return {r["runtime"]: (r["runs"], r["mtp"]) for r in report["runtimes"]}


def _copy(converted: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(converted, tmp_path / name))


def test_an_mtpkit_conversion_runs_with_its_head_everywhere(converted: Path) -> None:
    report = inspect_checkpoint(str(converted))
    assert report["mtp"]["layout"] == "mtpkit sidecar + mtp.safetensors for the MLX runtimes"
    assert report["mtp"]["peer_files"] == ["mtp.safetensors"]
    assert _runs(report) == {
        "mlx-lm": (True, False),
        "mtpkit": (True, True),
        "mlx-vlm": (True, True),
        "MTPLX": (True, True),
        "Rapid-MLX": (True, True),
        "vllm-mlx": (True, True),
        "LM Studio (mlx-engine)": (True, False),
    }


def test_inline_heads_break_the_runtimes_that_pin_older_mlx_lm(tmp_path: Path) -> None:
    out = convert(str(EXAMPLE), output=tmp_path / "inline", layout="inline").output
    report = inspect_checkpoint(str(out))
    assert report["mtp"]["layout"].startswith("mtpkit inline")
    runs = _runs(report)
    assert runs["MTPLX"] == runs["Rapid-MLX"] == runs["vllm-mlx"] == (False, False)
    assert runs["mlx-vlm"] == (True, True) and runs["mtpkit"] == (True, True)
    note = next(r["note"] for r in report["runtimes"] if r["runtime"] == "MTPLX")
    assert "mlx-lm 0.31" in note


def test_an_mtplx_sidecar_is_read_as_the_head(converted: Path, tmp_path: Path) -> None:
    d = _copy(converted, tmp_path, "mtplx")
    shutil.rmtree(d / "mtp")  # only mtp.safetensors, keys mtp.*, no manifest
    report = inspect_checkpoint(str(d))
    assert report["mtp"]["layout"] == "MTPLX sidecar (mtp.safetensors)"
    assert report["mtp"]["tensor_count"] == 15 and report["mtp"]["shards"] == ["mtp.safetensors"]
    assert _runs(report)["MTPLX"] == (True, True) and _runs(report)["mlx-vlm"] == (True, True)


def test_a_vllm_mlx_sidecar_lacks_what_mlx_vlm_reads(converted: Path, tmp_path: Path) -> None:
    d = _copy(converted, tmp_path, "vllm")
    (d / "mtp.safetensors").unlink()
    manifest = {"format": "vllm-mlx", "rmsnorm_weight_format": "mlx_gamma"}
    (d / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    report = inspect_checkpoint(str(d))
    assert report["mtp"]["layout"].startswith("vllm-mlx sidecar")
    runs = _runs(report)
    assert runs["mlx-vlm"] == runs["Rapid-MLX"] == (True, False)
    assert runs["MTPLX"] == (True, True)  # it reads mtp/weights.safetensors too
    note = next(r["note"] for r in report["runtimes"] if r["runtime"] == "vllm-mlx")
    assert "guesses the norms from their means" in note


def test_vllm_mlx_qwen3_next_layout_is_named(tmp_path: Path, checkpoint) -> None:
    out = convert(str(checkpoint("qwen3_next", dtype="float32")), output=tmp_path / "n").output
    shutil.rmtree(out / "mtp")
    (out / "mtp.safetensors").rename(out / "model-mtp.safetensors")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for name in mx.load(str(out / "model-mtp.safetensors")):
        index["weight_map"][name] = "model-mtp.safetensors"
    index["metadata"].pop("total_size")
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    report = inspect_checkpoint(str(out))
    assert report["mtp"]["layout"] == (
        "model-mtp.safetensors in the index (vllm-mlx's Qwen3-Next script)"
    )


def test_an_mlx_vlm_drafter_directory_is_recognised(converted: Path, tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    split = subprocess.run(
        [sys.executable, "-m", "mlx_vlm.split_mtp", "--model", str(converted), "--output", str(drafter)],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert split.returncode == 0, split.stderr
    report = inspect_checkpoint(str(drafter))
    assert report["format"] == "mlx-vlm-drafter" and report["family"] == "qwen3_5"
    assert report["mtp"]["tensor_count"] == 15 and report["problems"] == []
    assert _runs(report) == {
        "mlx-vlm": (True, True),
        "vllm-mlx": (True, True),
        "mtpkit": (False, False),
    }


@pytest.mark.parametrize("flags", [{"bits": 4, "mtp_bits": 8}])
def test_an_undeclared_head_precision_is_named(flags, tmp_path: Path) -> None:
    out = convert(str(EXAMPLE), output=tmp_path / "q", **flags).output
    config = json.loads((out / "config.json").read_text())
    config.pop("mtplx_mtp_quantization")
    (out / "config.json").write_text(json.dumps(config))
    report = inspect_checkpoint(str(out))
    row = next(r for r in report["runtimes"] if r["runtime"] == "mlx-vlm")
    assert not row["mtp"] and "mtplx_mtp_quantization" in row["note"]


def _notes(report: dict) -> dict[str, str]:
    return {r["runtime"]: r["note"] for r in report["runtimes"]}


def test_a_dense_model_gets_no_qwen3_5_recipe(tmp_path: Path) -> None:
    """A Llama (no head, no MTP drafter anywhere): mtpkit says how to get a head, vllm-mlx
    says why not rather than giving the Qwen3.5 drafter recipe (issue 32, 16)."""
    from tests.checkpoints import build_dense_model

    notes = _notes(inspect_checkpoint(str(build_dense_model(tmp_path / "llama", "llama"))))
    assert notes["mtpkit"] == "no MTP head: `mtpkit train-head` trains one"
    assert notes["mlx-vlm"] == notes["vllm-mlx"] == "no MTP drafter for llama"


def test_a_headless_conversion_gets_no_drafter_recipe(converted: Path, tmp_path: Path) -> None:
    headless = _copy(converted, tmp_path, "headless")
    shutil.rmtree(headless / "mtp")
    (headless / "mtp.safetensors").unlink()
    report = inspect_checkpoint(str(headless))
    notes = _notes(report)
    assert notes["mlx-vlm"] == notes["vllm-mlx"] == "no usable MTP head"
    assert "split_mtp" not in json.dumps(report["runtimes"])
    assert _runs(report)["vllm-mlx"] == (True, False)
