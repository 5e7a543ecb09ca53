"""A conversion carries what the MLX runtimes users already have read (issue 20).

What each peer reads is in `mtpkit/core/peers.py`; `tests/test_mlx_vlm.py` decodes with one of
them. Here: the files and keys are there, they agree with mtpkit's own record, and stock
mlx-lm is untouched by them (plain greedy identical, no remote-code question).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.convert.pipeline import INLINE_WARNING, convert
from tests.checkpoints import CheckpointFactory

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


def _stock_greedy(model_dir: Path, n: int = 24) -> list[int]:
    """Greedy tokens of stock mlx-lm (its own load and generate_step), EOS ignored."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    prompt = mx.array(tokenizer.encode("Create a new event loop. You"))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])


def test_the_peers_head_file_is_mtpkits_head_under_their_names(converted: Path) -> None:
    ours = mx.load(str(converted / "mtp" / "weights.safetensors"))
    theirs = mx.load(str(converted / "mtp.safetensors"))
    assert sorted(theirs) == sorted("mtp." + k.removeprefix("language_model.mtp.") for k in ours)
    for name, value in ours.items():
        peer = theirs["mtp." + name.removeprefix("language_model.mtp.")]
        assert peer.dtype == value.dtype and mx.array_equal(peer, value).item()
    # mlx-vlm adds +1 to the norms of a head without this metadata.
    assert _header(converted / "mtp.safetensors")["__metadata__"] == {"format": "mlx"}


def test_manifest_and_config_declare_the_head_where_the_peers_read_it(converted: Path) -> None:
    manifest = json.loads((converted / "mtp" / "manifest.json").read_text())
    assert manifest["format"] == "mtpkit"
    assert manifest["artifact_schema_version"] == 1  # vllm-mlx trusts the next key only with it
    assert manifest["rmsnorm_weight_format"] == "mlx_gamma"
    assert manifest["peer_files"] == {"mtp.safetensors": "mtp."}
    config = json.loads((converted / "config.json").read_text())
    assert config["mtp_hidden_state_mode"] == "post_norm"  # vllm-mlx's key for manifest "hidden"
    assert "mtplx_mtp_quantization" not in config  # a bf16 head: nothing to declare
    assert "config_dropped" not in manifest


def test_inspect_and_a_second_conversion_read_the_head_once(converted: Path, tmp_path) -> None:
    report = inspect_checkpoint(str(converted))
    assert report["mtp"]["tensor_count"] == 15 and report["problems"] == []
    assert report["mtp"]["shards"] == ["mtp/weights.safetensors"]
    again = convert(str(converted), output=tmp_path / "again")
    assert again.head_tensors == 15
    first = mx.load(str(converted / "mtp.safetensors"))
    second = mx.load(str(again.output / "mtp.safetensors"))
    assert all(mx.array_equal(first[k], second[k]).item() for k in first)  # nothing shifted twice


def test_stock_mlx_lm_never_reads_the_peer_file(converted: Path, tmp_path) -> None:
    without = tmp_path / "without"
    shutil.copytree(converted, without)
    (without / "mtp.safetensors").unlink()
    assert _stock_greedy(converted) == _stock_greedy(without)


@pytest.mark.parametrize(
    ("flags", "declared"),
    [
        ({"bits": 4, "mtp_bits": 8}, {"group_size": 64, "bits": 8, "mode": "affine"}),
        ({"bits": 4}, None),  # quantized like the backbone: config's `quantization` says it
        ({"bits": 4, "keep_mtp_bf16": True}, None),
    ],
    ids=["8bit-head", "4bit-head", "bf16-head"],
)
def test_head_bits_unlike_the_backbones_are_declared(flags, declared, tmp_path) -> None:
    out = convert(str(EXAMPLE), output=tmp_path / "out", **flags).output
    config = json.loads((out / "config.json").read_text())
    assert config.get("mtplx_mtp_quantization") == declared
    assert config["quantization"]["bits"] == 4


def test_inline_layout_warns_about_older_mlx_lm(tmp_path) -> None:
    result = convert(str(EXAMPLE), output=tmp_path / "inline", layout="inline")
    assert INLINE_WARNING in result.warnings
    assert "mlx-lm < 0.32" in INLINE_WARNING
    assert not convert(str(EXAMPLE), output=tmp_path / "sidecar").warnings


def test_graft_writes_the_peer_file_too(converted: Path, tmp_path) -> None:
    from mtpkit.convert.grafting import graft

    trunk = tmp_path / "trunk"
    shutil.copytree(converted, trunk)
    shutil.rmtree(trunk / "mtp")
    (trunk / "mtp.safetensors").unlink()
    graft(str(EXAMPLE), into=trunk)
    assert sorted(mx.load(str(trunk / "mtp.safetensors"))) == sorted(
        mx.load(str(converted / "mtp.safetensors"))
    )
    assert json.loads((trunk / "mtp" / "manifest.json").read_text())["artifact_schema_version"] == 1


AUTO_MAP = {"AutoConfig": "configuration_mimo.MiMoConfig"}


def test_remote_code_key_is_dropped_so_mlx_lm_never_asks(
    checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    source = tmp_path / "mimo"
    shutil.copytree(checkpoint("mimo"), source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    (source / "configuration_mimo.py").write_text("raise SystemExit('custom code ran')\n")
    out = convert(str(source), output=tmp_path / "out").output
    assert "auto_map" not in json.loads((out / "config.json").read_text())
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    assert manifest["config_dropped"] == {"auto_map": AUTO_MAP}
    assert not (out / "mtp.safetensors").exists()  # no peer runs a MiMo head from it
    # Stock mlx-lm, as a user runs it: stdin at end of file, nothing asked on stdout.
    code = f"from mlx_lm import load; load({str(out)!r}); print('loaded')"
    run = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == "loaded\n"


@pytest.mark.parametrize("into", [False, True], ids=["output", "into"])
def test_a_trained_head_is_written_for_the_peers_too(converted: Path, tmp_path, into) -> None:
    from mtpkit.families import family_for
    from mtpkit.train.output import write_trained_head

    headless = tmp_path / "headless"
    shutil.copytree(converted, headless)
    shutil.rmtree(headless / "mtp")
    (headless / "mtp.safetensors").unlink()
    head = family_for(json.loads((headless / "config.json").read_text())).build_head(1)
    target = headless if into else tmp_path / "out"
    where = {"into": headless} if into else {"output": target}
    write_trained_head(headless, head, hidden="post_norm", training={"model": "x"}, **where)
    ours = mx.load(str(target / "mtp" / "weights.safetensors"))
    theirs = mx.load(str(target / "mtp.safetensors"))
    assert sorted(theirs) == sorted("mtp." + k.removeprefix("language_model.mtp.") for k in ours)
    assert _header(target / "mtp.safetensors")["__metadata__"] == {"format": "mlx"}
    manifest = json.loads((target / "mtp" / "manifest.json").read_text())
    assert manifest["artifact_schema_version"] == 1 and "training" in manifest
    assert json.loads((target / "config.json").read_text())["mtp_hidden_state_mode"] == "post_norm"
    assert inspect_checkpoint(str(target))["mtp"]["tensor_count"] == len(ours)
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == []
