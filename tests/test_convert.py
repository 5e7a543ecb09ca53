"""`mtpkit convert`: stock mlx-lm is the reference for the backbone, the source for the head.

Every raw family is converted by mtpkit and by stock `mlx_lm.convert` with the same settings;
stock `mlx_lm.load` loads both and their parameters and logits must agree exactly. The head
is checked against the source tensors (names, stacking, the +1 shift, quantization).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from pathlib import Path

import huggingface_hub.hf_api  # noqa: F401 - the hub fixture patches it; import it first
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtpkit.checkpoint.headers import HEADER_PROBE_BYTES
from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.convert.grafting import graft
from mtpkit.convert.pipeline import convert
from mtpkit.core.errors import MtpkitError
from tests import hub_server
from tests.checkpoints import build_checkpoint

hub = hub_server.hub

MOE = (
    "qwen3_5_moe",
    "qwen3_6_moe",
    "qwen3_next",
    "deepseek_v3",
    "glm4_moe",
    "ernie4_5_moe",
    "exaone_moe",
    "mimo_v2_flash",
    "step3p5",
    "nemotron_h",
)
DENSE = ("qwen3_5", "mimo")
RAW = DENSE + MOE
PREFIX = {
    "qwen3_5": "language_model.mtp.",
    "qwen3_5_moe": "language_model.mtp.",
    "qwen3_6_moe": "language_model.mtp.",
    "qwen3_next": "mtp.",
    "deepseek_v3": "mtp.",
    "glm4_moe": "mtp.",
    "mimo": "mtp.",
    "ernie4_5_moe": "mtp.",
    "exaone_moe": "mtp.",
    "mimo_v2_flash": "mtp.",
    "step3p5": "mtp.",
    "nemotron_h": "mtp.",
}
# Fixtures with more than one MTP layer (MiMo-V2-Flash publishes three).
HEAD_LAYERS = {"mimo_v2_flash": 3, "step3p5": 2}
# Families whose head keeps fc and norms at its root (`mtp.fc`), not inside each layer.
QWEN_STYLE_ROOT = ("qwen3_next", "exaone_moe")
TOKENS = mx.array([[5, 17, 100, 3, 250, 42, 7, 9, 300, 11]])


def _dtype(layout: str) -> str:
    # MLX's CPU backend runs MoE layers in float32 only.
    return "float32" if layout in MOE else "bfloat16"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sources")
    cache: dict[tuple[str, bool], Path] = {}

    def get(layout: str, with_mtp: bool = True) -> Path:
        key = (layout, with_mtp)
        if key not in cache:
            path = root / f"{layout}{'' if with_mtp else '_nomtp'}"
            cache[key] = build_checkpoint(layout, path, dtype=_dtype(layout), with_mtp=with_mtp)
        return cache[key]

    return get


def _stock_convert(src: Path, out: Path, **kwargs) -> Path:
    from mlx_lm.convert import convert as stock

    with contextlib.redirect_stdout(io.StringIO()):
        stock(str(src), str(out), **kwargs)
    return out


def _load(path: Path):
    from mlx_lm import load

    model, _ = load(str(path))
    return model


def _params(model) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def _head(path: Path) -> dict[str, mx.array]:
    return mx.load(str(path / "mtp" / "weights.safetensors"))


def _source_tensors(path: Path) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    for shard in sorted(path.glob("model*.safetensors")):
        tensors.update(mx.load(str(shard)))
    return tensors


def _files(path: Path) -> dict[str, bytes]:
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- parity


# mlx_lm.convert's --q-mode and --quant-predicate choices, each with mlx-lm's defaults, on dense
# and MoE families (routers keep the model's own 8-bit rule, except under a mixed recipe,
# which replaces it as in mlx-lm).
QUANT_CASES = [
    ("qwen3_5", {"mode": "mxfp4"}),
    ("qwen3_5_moe", {"mode": "mxfp4"}),
    ("qwen3_5", {"mode": "nvfp4"}),
    ("qwen3_next", {"mode": "nvfp4"}),
    ("qwen3_5", {"mode": "mxfp8"}),
    ("mimo", {"mode": "mxfp8"}),
    ("qwen3_5", {"quant_predicate": "mixed_2_6"}),
    ("mimo", {"quant_predicate": "mixed_3_4"}),
    ("qwen3_5_moe", {"quant_predicate": "mixed_3_6"}),
    ("qwen3_5", {"quant_predicate": "mixed_4_6", "group_size": 32}),
    ("deepseek_v3", {"quant_predicate": "mixed_3_6", "bits": 3}),
]
STOCK_NAMES = {"bits": "q_bits", "group_size": "q_group_size", "mode": "q_mode"}


@pytest.mark.parametrize(
    ("layout", "quant", "dtype"),
    [(layout, {"bits": bits} if bits else {}, None) for layout in RAW for bits in (None, 4)]
    + [(layout, quant, None) for layout, quant in QUANT_CASES]
    + [("qwen3_5", {}, "float16"), ("mimo", {"bits": 8}, "float16")]
    + [("qwen3_next", {"bits": 4}, "bfloat16")],
)
def test_backbone_equals_stock_mlx_lm_convert(layout, quant, dtype, sources, tmp_path):
    src = sources(layout)
    out = convert(
        str(src), output=tmp_path / "out", dtype=dtype, quantize=bool(quant), **quant
    ).output
    # Stock deepseek_v3 drops its MTP layer by a literal index (61), so it is given the twin
    # without the head; the backbones are identical bit for bit.
    ref_src = sources(layout, with_mtp=False) if layout == "deepseek_v3" else src
    stock_kwargs = {STOCK_NAMES.get(k, k): v for k, v in quant.items()}
    if quant:
        stock_kwargs["quantize"] = True
    if dtype:
        stock_kwargs["dtype"] = dtype
    ref = _stock_convert(ref_src, tmp_path / "ref", **stock_kwargs)

    mine, theirs = _load(out), _load(ref)
    a, b = _params(mine), _params(theirs)
    assert a.keys() == b.keys()
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    # To float16 from bf16, stock rounds the +1 shift to bf16 first; mtpkit rounds once, from
    # float32. Only those norms differ, each by at most stock's bf16 rounding step (2^-7).
    rounded_twice = set(manifest["norm_shift"]["backbone"]) if dtype == "float16" else set()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        if name in rounded_twice:
            assert mx.allclose(a[name], b[name], atol=2**-7, rtol=0).item(), name
        else:
            assert mx.array_equal(a[name], b[name]).item(), name
    if rounded_twice:
        assert mx.allclose(mine(TOKENS), theirs(TOKENS), rtol=1e-2, atol=1e-2).item()
    else:
        assert mx.array_equal(mine(TOKENS), theirs(TOKENS)).item()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ref_index = json.loads((ref / "model.safetensors.index.json").read_text())
    assert index["metadata"] == ref_index["metadata"]  # total_size and total_parameters
    assert index["weight_map"].keys() == ref_index["weight_map"].keys()
    if quant:
        config = json.loads((out / "config.json").read_text())
        ref_config = json.loads((ref / "config.json").read_text())
        backbone_quant = {
            k: v for k, v in config["quantization"].items() if not k.startswith(PREFIX[layout])
        }
        assert backbone_quant == ref_config["quantization"]
        assert manifest["backbone_quantization"]["mode"] == quant.get("mode", "affine")


def test_float32_output_shifts_in_float32(sources, tmp_path):
    """--dtype float32 matches a float32 forward of the bf16 checkpoint; stock drifts."""
    src = sources("qwen3_5")
    out = convert(str(src), output=tmp_path / "out", dtype="float32").output
    # Independent reference: the same checkpoint upcast to float32 *before* stock mlx-lm's
    # sanitize, so its +1 shift happens in float32.
    upcast = tmp_path / "upcast"
    upcast.mkdir()
    for item in src.iterdir():
        if item.suffix == ".safetensors":
            tensors = {k: v.astype(mx.float32) for k, v in mx.load(str(item)).items()}
            mx.save_safetensors(str(upcast / item.name), tensors, metadata={"format": "pt"})
        else:
            shutil.copy(item, upcast / item.name)
    from mlx_lm.utils import load_model

    reference, _ = load_model(upcast)
    stock = _load(_stock_convert(src, tmp_path / "stock", dtype="float32"))
    mine = _load(out)
    want = reference(TOKENS)
    scale = mx.abs(want).max().item()
    mine_err = mx.abs(mine(TOKENS) - want).max().item() / scale
    stock_err = mx.abs(stock(TOKENS) - want).max().item() / scale
    assert mine_err < 1e-3
    assert mine_err < stock_err / 10


# --------------------------------------------------------------------------- the head


@pytest.mark.parametrize("layout", RAW)
def test_head_names_shift_and_manifest(layout, sources, tmp_path):
    src = sources(layout)
    result = convert(str(src), output=tmp_path / "out")
    out = result.output
    head = _head(out)
    prefix = PREFIX[layout]
    assert head and all(
        k.startswith(
            prefix + ("layers." if prefix == "mtp." and layout not in QWEN_STYLE_ROOT else "")
        )
        for k in head
    )
    source = _source_tensors(src)
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    assert manifest["format"] == "mtpkit" and manifest["family"] == result.family
    layers = HEAD_LAYERS.get(layout, 1)
    assert manifest["prefix"] == prefix and manifest["num_layers"] == layers
    assert manifest["hidden"] == "post_norm"
    assert manifest["concat_order"] == ("hidden_first" if layout == "mimo" else "embedding_first")
    for key in (
        "mtpkit_version",
        "source",
        "weights",
        "norm_shift",
        "expert_layout",
        "mtp_dtype",
        "mtp_quantization",
        "backbone_quantization",
        "dropped",
        "rmsnorm_weight_format",
    ):
        assert key in manifest
    config = json.loads((out / "config.json").read_text())
    if layout.startswith("qwen3_5") or layout == "qwen3_6_moe":
        assert config["text_config"]["mtp_num_hidden_layers"] == 1
        norm = head[prefix + "pre_fc_norm_hidden.weight"]
        raw = source["mtp.pre_fc_norm_hidden.weight"].astype(mx.float32)
        assert mx.array_equal(norm, (raw + 1.0).astype(norm.dtype)).item()
        assert prefix + "pre_fc_norm_hidden.weight" in manifest["norm_shift"]["mtp"]
        assert manifest["rmsnorm_weight_format"] == "mlx_gamma"
        # The gated delta net's own norm is not zero-centred: never shifted.
        assert not any("linear_attn.norm" in k for k in manifest["norm_shift"]["backbone"])
    elif layout == "qwen3_next":
        assert config["num_nextn_predict_layers"] == 1
        assert manifest["rmsnorm_weight_format"] == "mlx_gamma"
    elif layout == "step3p5":  # every norm zero-centred, the nextn ones included
        assert config["num_nextn_predict_layers"] == layers
        assert manifest["rmsnorm_weight_format"] == "mlx_gamma"
        n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        raw = source[f"model.layers.{n}.transformer.shared_head.norm.weight"].astype(mx.float32)
        norm = head["mtp.layers.0.shared_head.norm.weight"]
        assert mx.array_equal(norm, (raw + 1.0).astype(norm.dtype)).item()
        assert f"model.layers.{n}.transformer.shared_head.output.weight" in manifest["dropped"]
    else:
        assert config["num_nextn_predict_layers"] == layers
        assert manifest["rmsnorm_weight_format"] == "plain"
        assert manifest["norm_shift"]["mtp"] == [] and manifest["norm_shift"]["backbone"] == []
    if layout in ("deepseek_v3", "glm4_moe"):
        n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        assert f"model.layers.{n}.embed_tokens.weight" in manifest["dropped"]
        assert f"model.layers.{n}.shared_head.head.weight" in manifest["dropped"]
        assert not any("embed_tokens" in k or "shared_head.head" in k for k in head)
        assert mx.array_equal(
            head["mtp.layers.0.eh_proj.weight"], source[f"model.layers.{n}.eh_proj.weight"]
        ).item()
    if layout == "mimo":
        assert mx.array_equal(
            head["mtp.layers.0.input_proj.weight"], source["model.mtp_layers.0.input_proj.weight"]
        ).item()
        assert "mtp.layers.0.self_attn.q_proj.bias" in head
    if layout in ("qwen3_5_moe", "qwen3_next"):
        src_prefix = "mtp.layers.0.mlp.experts"
        stacked = head[f"{prefix}layers.0.mlp.switch_mlp.up_proj.weight"]
        want = mx.stack([source[f"{src_prefix}.{e}.up_proj.weight"] for e in range(4)])
        assert mx.array_equal(stacked, want).item()
        assert manifest["expert_layout"] == {"source": "per_expert", "output": "stacked"}
    if layout == "qwen3_6_moe":
        gate_up = source["mtp.layers.0.mlp.experts.gate_up_proj"]
        mid = gate_up.shape[1] // 2
        assert mx.array_equal(
            head[f"{prefix}layers.0.mlp.switch_mlp.gate_proj.weight"], gate_up[:, :mid]
        ).item()
        assert mx.array_equal(
            head[f"{prefix}layers.0.mlp.switch_mlp.up_proj.weight"], gate_up[:, mid:]
        ).item()
        assert manifest["expert_layout"] == {"source": "fused", "output": "stacked"}
    # inspect reads the manifest: the convention is recorded, not guessed.
    report = inspect_checkpoint(str(out))
    assert report["problems"] == []
    assert report["mtp"]["norm_convention"] == (
        "plain" if manifest["rmsnorm_weight_format"] == "plain" else "shifted"
    )


def test_head_quantization_flags(sources, tmp_path):
    src = sources("qwen3_5_moe")
    out = convert(str(src), output=tmp_path / "q", bits=4).output
    head = _head(out)
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    fc = "language_model.mtp.fc"
    assert head[f"{fc}.weight"].dtype == mx.uint32 and quant[fc] == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }
    # Routers stay 8-bit group 64 in the head as in the backbone.
    assert quant["language_model.mtp.layers.0.mlp.gate"] == {
        "group_size": 64,
        "bits": 8,
        "mode": "affine",
    }
    assert quant["language_model.mtp.layers.0.mlp.shared_expert_gate"] == {
        "group_size": 64,
        "bits": 8,
        "mode": "affine",
    }
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    assert manifest["mtp_quantization"] == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert manifest["backbone_quantization"] == {"bits": 4, "group_size": 64, "mode": "affine"}

    kept = convert(str(src), output=tmp_path / "kept", bits=4, keep_mtp_bf16=True).output
    head = _head(kept)
    assert not any(k.endswith(".scales") for k in head)
    assert {v.dtype for v in head.values()} == {mx.bfloat16}
    quant = json.loads((kept / "config.json").read_text())["quantization"]
    assert quant[fc] is False and quant["language_model.mtp.layers.0.mlp.gate"] is False
    assert quant["bits"] == 4
    _load(kept)  # stock mlx-lm still loads the quantized backbone

    half = convert(
        str(src), output=tmp_path / "half", keep_mtp_bf16=True, bits=4, dtype="float16"
    ).output
    assert {v.dtype for v in _head(half).values()} == {mx.float16}

    eight = convert(str(src), output=tmp_path / "eight", bits=4, mtp_bits=8).output
    quant = json.loads((eight / "config.json").read_text())["quantization"]
    assert quant[fc] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert json.loads((eight / "mtp" / "manifest.json").read_text())["mtp_quantization"] == {
        "bits": 8,
        "group_size": 64,
        "mode": "affine",
    }

    # Head quantized, backbone not: the config carries only the head's paths, and stock loads.
    only_head = convert(str(sources("qwen3_5")), output=tmp_path / "only_head", mtp_bits=4).output
    quant = json.loads((only_head / "config.json").read_text())["quantization"]
    assert quant["language_model.mtp.fc"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    _load(only_head)


def test_inline_layout(sources, tmp_path):
    src = sources("qwen3_5")
    out = convert(str(src), output=tmp_path / "out", layout="inline").output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    inline = [k for k in index["weight_map"] if k.startswith("language_model.mtp.")]
    assert sorted(inline) == sorted(_head(out))
    _load(out)  # stock mlx-lm drops language_model.mtp.* itself
    again = convert(str(out), output=tmp_path / "again", layout="inline").output
    assert _files(again).keys() == _files(out).keys()
    for name, data in _files(out).items():
        if name != "mtp/manifest.json":
            assert _files(again)[name] == data, name
    with pytest.raises(MtpkitError, match="Qwen3.5/3.6"):
        convert(str(sources("mimo")), output=tmp_path / "m", layout="inline")


# --------------------------------------------------------------------------- idempotence


@pytest.mark.parametrize("layout", RAW)
def test_convert_twice_changes_nothing(layout, sources, tmp_path):
    first = convert(
        str(sources(layout)), output=tmp_path / "one", bits=4 if layout in MOE else None
    ).output
    second = convert(str(first), output=tmp_path / "two").output
    a, b = _files(first), _files(second)
    assert a.keys() == b.keys()
    for name in a:
        if name != "mtp/manifest.json":
            assert a[name] == b[name], name
    m1 = json.loads(a["mtp/manifest.json"])
    m2 = json.loads(b["mtp/manifest.json"])
    assert m1["norm_shift"] == m2["norm_shift"] and m1["source"] == m2["source"]


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
def test_quantizing_a_converted_directory_equals_quantizing_the_source(layout, sources, tmp_path):
    src = sources(layout)
    plain = convert(str(src), output=tmp_path / "plain").output
    twice = convert(str(plain), output=tmp_path / "twice", bits=4).output
    once = convert(str(src), output=tmp_path / "once", bits=4).output
    a, b = _files(twice), _files(once)
    assert a.keys() == b.keys()
    for name in a:
        if name not in ("mtp/manifest.json", "config.json"):
            assert a[name] == b[name], name
    assert (
        json.loads(a["config.json"])["quantization"] == json.loads(b["config.json"])["quantization"]
    )


def test_mlx_inline_source_is_rewritten_unchanged(sources, tmp_path):
    src = build_checkpoint("mlx_inline", tmp_path / "inline", dtype="bfloat16")
    out = convert(str(src), output=tmp_path / "out").output
    before, after = _source_tensors(src), _source_tensors(out) | _head(out)
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and mx.array_equal(before[k], after[k]).item(), k
    with pytest.raises(MtpkitError, match="already quantized"):
        convert(str(src), output=tmp_path / "again", bits=4)


@pytest.mark.parametrize("layout", RAW)
def test_graft_twice_changes_nothing(layout, sources, tmp_path):
    src = sources(layout)
    trunk = tmp_path / "trunk"
    _stock_convert(sources(layout, with_mtp=False), trunk, quantize=True, q_bits=4, q_group_size=64)
    graft(str(src), into=trunk)
    once = _files(trunk)
    graft(str(src), into=trunk, force=True)
    assert _files(trunk) == once
    head = _head(trunk)
    assert any(k.endswith(".scales") for k in head)  # quantized like the trunk
    _load(trunk)
    reference = _head(convert(str(src), output=tmp_path / "full", bits=4).output)
    assert head.keys() == reference.keys()
    for k in head:
        assert mx.array_equal(head[k], reference[k]).item(), k


def test_graft_into_published_stripped_build(tmp_path, sources):
    trunk = build_checkpoint("mlx_plain", tmp_path / "plain", dtype="bfloat16")
    assert inspect_checkpoint(str(trunk))["problems"][0]["code"] == "mtp_declared_not_present"
    graft(str(sources("qwen3_5")), into=trunk, keep_mtp_bf16=True)
    report = inspect_checkpoint(str(trunk))
    assert report["problems"] == [] and report["mtp"]["norm_convention"] == "shifted"
    assert not report["mtp"]["quantized"]


def test_graft_refuses_other_model(sources, tmp_path):
    trunk = _stock_convert(sources("mimo"), tmp_path / "trunk")
    with pytest.raises(MtpkitError, match="is not the model of"):
        graft(str(sources("qwen3_5")), into=trunk)
    other = tmp_path / "other"
    build_checkpoint("mimo", other, vocab_size=384)
    with pytest.raises(MtpkitError, match="vocab_size 512 vs 384"):
        graft(str(other), into=trunk)


# --------------------------------------------------------------------------- safety


def test_existing_output_needs_force(sources, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(MtpkitError, match="already exists"):
        convert(str(sources("mimo")), output=out)
    assert (out / "keep.txt").exists()
    # --force replaces only a model directory, an earlier output or an empty directory
    with pytest.raises(MtpkitError, match="--force replaces only a model directory"):
        convert(str(sources("mimo")), output=out, force=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    convert(str(sources("mimo")), output=out, force=True)  # empty
    convert(str(sources("mimo")), output=out, force=True)  # an earlier output
    assert (out / "mtp" / "manifest.json").exists()


def test_problem_source_is_refused_without_output(tmp_path):
    src = build_checkpoint("stripped", tmp_path / "stripped")
    with pytest.raises(MtpkitError, match="mtp_declared_not_present"):
        convert(str(src), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def add_tensor(src: Path, shard_name: str, name: str, value: mx.array) -> None:
    """Add one tensor to a shard of a raw checkpoint and keep its index consistent."""
    shard = src / shard_name
    tensors = mx.load(str(shard))
    tensors[name] = value
    mx.save_safetensors(str(shard), tensors, metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = shard_name
    index["metadata"]["total_size"] += value.nbytes
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def test_unknown_tensor_is_refused_by_name(sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(sources("mimo"), src)
    add_tensor(
        src, "model-00001-of-00002.safetensors", "model.layers.0.mystery.weight", mx.zeros((4, 4))
    )
    with pytest.raises(MtpkitError, match=r"model\.layers\.0\.mystery\.weight"):
        convert(str(src), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_head_tensor_is_refused_by_name(sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(sources("qwen3_5"), src)
    add_tensor(
        src,
        "model-00002-of-00002.safetensors",
        "mtp.layers.0.extra_norm.weight",
        mx.ones((64,), dtype=mx.bfloat16),
    )
    with pytest.raises(MtpkitError, match=r"\(MTP head\).*mtp\.layers\.0\.extra_norm\.weight"):
        convert(str(src), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_run_leaves_nothing(sources, tmp_path, monkeypatch):
    import mtpkit.convert.pipeline as conv

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_copy_side_files", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(str(sources("mimo")), output=tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_failure_while_writing_leaves_nothing(sources, tmp_path, monkeypatch):
    import mtpkit.convert.pipeline as conv

    real = conv.job_computer
    calls = []

    def failing_computer():
        compute = real()

        def failing(job):
            calls.append(job)
            if len(calls) == 5:
                raise OSError("disk full")
            return compute(job)

        return failing

    monkeypatch.setattr(conv, "job_computer", failing_computer)
    with pytest.raises(MtpkitError, match="nothing was written: disk full"):
        convert(str(sources("qwen3_5_moe")), output=tmp_path / "out", bits=4)
    assert list(tmp_path.iterdir()) == []


def _write_fp8_copy(src: Path, dst: Path, names: list[str]) -> None:
    """Copy a checkpoint with `names` stored as FP8 (E4M3) plus block-128 `weight_scale_inv`."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(dst.glob("model-*.safetensors")):
        tensors = mx.load(str(shard))
        header: dict[str, dict] = {}
        chunks: list[bytes] = []
        offset = 0
        for name, array in tensors.items():
            if name in names:
                scale = mx.array(np.full((1, 1), 0.5, dtype=np.float32))
                fp8 = mx.to_fp8(array.astype(mx.float32) / 0.5)
                items = [(name, "F8_E4M3", fp8), (name + "_scale_inv", "F32", scale)]
                index["weight_map"][name + "_scale_inv"] = shard.name
            else:
                items = [(name, {mx.float32: "F32", mx.bfloat16: "BF16"}[array.dtype], array)]
            for key, dtype, value in items:
                data = bytes(
                    memoryview(value.view(mx.uint16) if value.dtype == mx.bfloat16 else value)
                )
                header[key] = {
                    "dtype": dtype,
                    "shape": list(value.shape),
                    "data_offsets": [offset, offset + len(data)],
                }
                chunks.append(data)
                offset += len(data)
        raw = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(chunks))
    index["metadata"].pop("total_size", None)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def test_deepseek_fp8_is_dequantized_like_mlx_lm(sources, tmp_path):
    fp8 = ["model.layers.1.self_attn.q_a_proj.weight", "model.layers.2.eh_proj.weight"]
    src = tmp_path / "fp8"
    _write_fp8_copy(sources("deepseek_v3"), src, fp8)
    ref_src = tmp_path / "fp8_nomtp"
    _write_fp8_copy(sources("deepseek_v3", with_mtp=False), ref_src, fp8[:1])
    out = convert(str(src), output=tmp_path / "out").output
    ref = _stock_convert(ref_src, tmp_path / "ref")
    a, b = _params(_load(out)), _params(_load(ref))
    name = "model.layers.1.self_attn.q_a_proj.weight"
    assert a[name].dtype == b[name].dtype and mx.array_equal(a[name], b[name]).item()
    assert "mtp.layers.0.eh_proj.weight" in _head(out)


# --------------------------------------------------------------------------- the Hub


def test_graft_from_hub_reads_only_the_head(hub, sources, tmp_path):
    src = sources("deepseek_v3")
    hub.add_repo("org/ds", src)
    trunk = _stock_convert(sources("deepseek_v3", with_mtp=False), tmp_path / "trunk")
    report = inspect_checkpoint(str(src))
    needed = report["mtp"]["bytes_needed"]
    hub.reset_counters()
    graft("org/ds", into=trunk)
    served = hub.total_bytes("org/ds")
    assert served <= 1.02 * needed + (1 << 20)
    head = _head(trunk)
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in head)
    manifest = json.loads((trunk / "mtp" / "manifest.json").read_text())
    assert manifest["source"]["spec"] == "org/ds" and len(manifest["source"]["commit"]) == 40


def test_convert_deepseek_from_hub_skips_duplicates(hub, sources, tmp_path):
    src = sources("deepseek_v3")
    hub.add_repo("org/ds", src)
    out = convert("org/ds", output=tmp_path / "out", bits=4).output
    report = inspect_checkpoint(str(src))
    duplicates = sum(t["bytes"] for t in report["mtp"]["tensors"] if "duplicate_of" in t)
    shards = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    served = sum(n for k, n in hub.bytes_served.items() if k.endswith(".safetensors"))
    header_probes = len(list(src.glob("*.safetensors"))) * HEADER_PROBE_BYTES
    assert duplicates > 0 and served <= shards - duplicates + header_probes
    local = convert(str(src), output=tmp_path / "local", bits=4).output
    for name in ("model-00001-of-00001.safetensors", "mtp/weights.safetensors"):
        assert (out / name).read_bytes() == (local / name).read_bytes()


def test_convert_from_hub(hub, sources, tmp_path):
    sha = hub.add_repo("org/mimo", sources("mimo"), revision="v1")
    out = convert("org/mimo", revision="v1", output=tmp_path / "out").output
    local = convert(str(sources("mimo")), output=tmp_path / "local").output
    for name in ("model-00001-of-00001.safetensors", "mtp/weights.safetensors"):
        assert (out / name).read_bytes() == (local / name).read_bytes()
    assert (out / "tokenizer.json").exists() and (out / "generation_config.json").exists()
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    assert manifest["source"] == {"spec": "org/mimo", "revision": "v1", "commit": sha}


# --------------------------------------------------------------------------- Gemma 4 targets


@pytest.mark.parametrize(
    ("text_only", "moe", "quant"),
    [
        (False, False, {}),
        (False, False, {"bits": 4}),
        (True, False, {}),
        (False, False, {"quant_predicate": "mixed_3_6"}),
        (False, True, {}),
        (False, True, {"bits": 4}),
    ],
)
def test_gemma4_target_equals_stock_mlx_lm_convert(text_only, moe, quant, tmp_path):
    """A Gemma 4 target converts to exactly what `mlx_lm.convert` writes: E2B-like (per-layer
    inputs, KV-shared layers, a vision tower to drop) and 26B-A4B-like (fused experts split
    into mlx-lm's `switch_glu`, 8-bit routers when quantized)."""
    from tests.gemma4_checkpoints import build_target

    # MLX's CPU backend runs MoE layers in float32 only.
    dtype = "float32" if moe else "bfloat16"
    src = build_target(tmp_path / "src", text_only=text_only, moe=moe, dtype=dtype)
    out = convert(str(src), output=tmp_path / "out", quantize=bool(quant), **quant).output
    stock_kwargs = {STOCK_NAMES.get(k, k): v for k, v in quant.items()}
    if quant:
        stock_kwargs["quantize"] = True
    ref = _stock_convert(src, tmp_path / "ref", **stock_kwargs)
    mine, theirs = _load(out), _load(ref)
    a, b = _params(mine), _params(theirs)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert mx.array_equal(a[name], b[name]).item(), name
    assert mx.array_equal(mine(TOKENS), theirs(TOKENS)).item()
    config = json.loads((out / "config.json").read_text())
    ref_config = json.loads((ref / "config.json").read_text())
    assert config.get("quantization") == ref_config.get("quantization")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ref_index = json.loads((ref / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == ref_index["weight_map"].keys()
    assert not any("vision_tower" in k for k in a)
    if not moe:  # KV-shared layers (4 and 5) compute no K/V
        assert not any("k_proj" in k and ".layers.5." in k for k in a)
