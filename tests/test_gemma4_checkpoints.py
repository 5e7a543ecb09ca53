"""`inspect` and `convert` on Gemma 4 targets and their assistants (tiny checkpoints in the
published formats, `tests/gemma4_checkpoints.py`)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from mtpkit.core.errors import MtpkitError
from mtpkit.families.gemma4_assistant import pairing_problems
from mtpkit.runtime.assistant import load_assistant
from tests.gemma4_checkpoints import (
    assistant_config,
    build_assistant,
    build_target,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gemma4")
    return {
        "target": build_target(root / "target", dtype="bfloat16"),
        "dense": build_assistant(root / "dense", dtype="bfloat16"),
        "masked": build_assistant(
            root / "masked", ordered=True, dtype="bfloat16", with_lm_head=True, shards=2
        ),
    }


def _codes(report: dict) -> set[str]:
    return {p["code"] for p in report["problems"]}


# --------------------------------------------------------------------------- inspect


def test_inspect_target_names_the_layers_an_assistant_reads(built):
    report = inspect_checkpoint(str(built["target"]))
    assert report["family"] == "gemma4"
    assert report["mtp"]["present"] is False
    assert report["problems"] == []
    pairing = report["pairing"]
    # Layers 0..3 compute K/V (4 and 5 are KV-shared): the last sliding is 3, the last full 2.
    assert pairing["kv_source_layers"] == {"sliding_attention": 3, "full_attention": 2}
    assert pairing["assistant"] == {
        "backbone_hidden_size": 64,
        "vocab_size": 512,
        "layer_types": ["full_attention", "sliding_attention"],
        "head_dim": {"sliding_attention": 16, "full_attention": 32},
        "attention_heads_multiple_of": 1,
    }
    mtpkit = next(r for r in report["runtimes"] if r["runtime"] == "mtpkit")
    assert mtpkit["note"] == "no head: it drafts with its assistant (--draft-model ASSISTANT)"


@pytest.mark.parametrize("head", ["dense", "masked"])
def test_inspect_assistant_pairing_facts(built, head):
    report = inspect_checkpoint(str(built[head]))
    assert report["family"] == "gemma4_assistant"
    assert report["problems"] == []
    assert report["mtp"]["layout"].startswith("standalone drafter")
    pairing = report["pairing"]
    assert pairing["backbone_hidden_size"] == 64
    assert pairing["vocab_size"] == 512
    assert pairing["layer_types"] == ["full_attention", "sliding_attention"]
    assert pairing["ordered_embeddings"] is (head == "masked")
    assert pairing["output_head"] == ("centroid-masked" if head == "masked" else "dense")
    rows = {r["runtime"]: r for r in report["runtimes"]}
    assert rows["mlx-lm"]["runs"] is False
    target = inspect_checkpoint(str(built["target"]))["pairing"]
    assert pairing_problems(pairing, target) == []


def test_assistant_for_another_target_does_not_pair(built, tmp_path):
    path = build_assistant(
        tmp_path / "other",
        config={**assistant_config(), "backbone_hidden_size": 96},
        dtype="bfloat16",
    )
    report = inspect_checkpoint(str(path))
    target = inspect_checkpoint(str(built["target"]))["pairing"]
    assert pairing_problems(report["pairing"], target) == [
        "the assistant drafts for hidden size 96, the target's is 64"
    ]


def test_missing_token_ordering_is_a_problem(built, tmp_path):
    src = tmp_path / "masked"
    shutil.copytree(built["masked"], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("masked_embedding.token_ordering")
    tensors = mx.load(str(src / shard))
    del tensors["masked_embedding.token_ordering"]
    mx.save_safetensors(str(src / shard), tensors, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    report = inspect_checkpoint(str(src))
    assert "missing_token_ordering" in _codes(report)
    result = CliRunner().invoke(app, ["inspect", str(src), "--require-mtp", "--json"])
    assert result.exit_code == 3
    with pytest.raises(MtpkitError, match="missing_token_ordering"):
        convert(str(src), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_projection_sized_for_no_target_is_a_problem(tmp_path):
    # The config says 64 but the projections were made for a target of hidden size 48.
    path = build_assistant(
        tmp_path / "odd", config={**assistant_config(), "backbone_hidden_size": 48}
    )
    config = json.loads((path / "config.json").read_text())
    config["backbone_hidden_size"] = 64
    (path / "config.json").write_text(json.dumps(config))
    report = inspect_checkpoint(str(path))
    messages = [p["message"] for p in report["problems"] if p["code"] == "assistant_unpairable"]
    assert messages == [
        "pre_projection.weight is sized for a target of hidden size 48 but "
        "backbone_hidden_size is 64: no target fits both",
        "post_projection.weight is sized for a target of hidden size 48 but "
        "backbone_hidden_size is 64: no target fits both",
    ]


# --------------------------------------------------------------------------- convert


def _logits(model, seed: int = 0) -> mx.array:
    """One draft step on fixed random inputs (the target's K/V and hidden state)."""
    key = mx.random.key(seed)
    k = mx.random.split(key, 6)
    kv = {
        "sliding_attention": (
            mx.random.normal((1, 1, 5, 16), key=k[0]),
            mx.random.normal((1, 1, 5, 16), key=k[1]),
        ),
        "full_attention": (
            mx.random.normal((1, 1, 5, 32), key=k[2]),
            mx.random.normal((1, 1, 5, 32), key=k[3]),
        ),
    }
    embedded = mx.random.normal((1, 1, 64), key=k[4]).astype(mx.bfloat16)
    hidden = mx.random.normal((1, 1, 64), key=k[5]).astype(mx.bfloat16)
    logits, _ = model(embedded, hidden, kv, 5)
    return logits.astype(mx.float32)


@pytest.mark.parametrize("head", ["dense", "masked"])
def test_convert_assistant_keeps_bf16_and_records_it(built, head, tmp_path):
    out = convert(str(built[head]), output=tmp_path / "out").output
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(mx.load(str(shard)))
    assert "lm_head.weight" not in tensors
    floats = {a.dtype for n, a in tensors.items() if n != "masked_embedding.token_ordering"}
    assert floats == {mx.bfloat16}
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    drafter = manifest["drafter"]
    assert drafter["family"] == "gemma4_assistant"
    assert drafter["dtype"] == "bfloat16"
    assert drafter["quantized"] is False
    if head == "masked":
        assert tensors["masked_embedding.token_ordering"].dtype == mx.int32
        assert drafter["integer_buffers"] == {"masked_embedding.token_ordering": "int32"}
        assert drafter["tied_head"] == "dropped"  # the fixture saved lm_head.weight too
        assert "lm_head.weight" in manifest["dropped"]
    # The converted assistant drafts exactly as the published one.
    assert mx.array_equal(_logits(load_assistant(out)), _logits(load_assistant(built[head])))
    # Converting the output again changes nothing.
    again = convert(str(out), output=tmp_path / "again").output
    for shard in out.glob("*.safetensors"):
        first, second = mx.load(str(shard)), mx.load(str(again / shard.name))
        assert first.keys() == second.keys()
        assert all(mx.array_equal(first[n], second[n]).item() for n in first)


def test_convert_assistant_quantized(built, tmp_path):
    out = convert(str(built["masked"]), output=tmp_path / "out", quantize=True, bits=8).output
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(mx.load(str(shard)))
    assert "model.embed_tokens.scales" not in tensors  # 32 columns: below mlx-lm's group of 64
    assert "model.layers.0.mlp.down_proj.scales" in tensors
    assert "masked_embedding.centroids.scales" not in tensors
    assert tensors["masked_embedding.token_ordering"].dtype == mx.int32
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    assert manifest["drafter"]["quantized"] is True
    quantized = np.array(_logits(load_assistant(out)))
    reference = np.array(_logits(load_assistant(built["masked"])))
    # 8-bit weights: the same greedy token, logits within quantization noise.
    assert quantized.argmax() == reference.argmax()
