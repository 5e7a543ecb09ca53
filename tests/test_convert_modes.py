"""mlx-lm's quantization modes and mixed recipes: the head's own choice on top of the backbone's,
and every reader (check, the runtime, stock mlx-lm) understanding the result.

The backbone's bit-identity with stock `mlx_lm.convert` per mode and recipe is proved in
tests/test_convert.py (`test_backbone_equals_stock_mlx_lm_convert`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.check import check_checkpoint
from mtpkit.convert import convert
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.generate import generate
from tests.checkpoints import build_checkpoint

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
HEAD = "language_model.mtp."


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("moe"), dtype="float32")


def _quant(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization"]


def _manifest(out: Path) -> dict:
    return json.loads((out / "mtp" / "manifest.json").read_text())


def _head(out: Path) -> dict[str, mx.array]:
    return mx.load(str(out / "mtp" / "weights.safetensors"))


def test_head_takes_the_backbones_mode_and_its_own_choice(moe: Path, tmp_path: Path) -> None:
    out = convert(str(moe), output=tmp_path / "fp4", mode="mxfp4").output
    quant, head = _quant(out), _head(out)
    fc = HEAD + "fc"
    assert quant[fc] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    assert head[f"{fc}.scales"].dtype == mx.uint8 and f"{fc}.biases" not in head
    # The model's own rule holds in the head as in the backbone: routers affine 8-bit.
    router = HEAD + "layers.0.mlp.gate"
    assert quant[router] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert _manifest(out)["mtp_quantization"] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
    assert _manifest(out)["backbone_quantization"] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}

    eight = convert(str(moe), output=tmp_path / "eight", mode="mxfp4", mtp_bits=8).output
    assert _quant(eight)[fc] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert _quant(eight)["mode"] == "mxfp4"  # the backbone's default is untouched
    kept = convert(str(moe), output=tmp_path / "kept", mode="nvfp4", keep_mtp_bf16=True).output
    assert not any(k.endswith(".scales") for k in _head(kept)) and _quant(kept)[fc] is False
    for directory in (out, eight, kept):
        mlx_lm.load(str(directory))  # stock mlx-lm builds the same layers
        assert load_model(directory).head is not None  # and so does mtpkit's runtime


def test_head_follows_the_mixed_recipe_as_the_layer_after_the_last(tmp_path: Path) -> None:
    out = convert(str(EXAMPLE), output=tmp_path / "mixed", quant_predicate="mixed_3_6").output
    quant = _quant(out)
    # Past 7/8 of the depth, mlx-lm's recipe gives v_proj and down_proj the high bits.
    assert quant[HEAD + "layers.0.mlp.down_proj"]["bits"] == 6
    assert quant[HEAD + "layers.0.self_attn.v_proj"]["bits"] == 6
    assert quant[HEAD + "layers.0.self_attn.q_proj"]["bits"] == 3
    assert quant[HEAD + "fc"]["bits"] == 3
    assert _manifest(out)["backbone_quantization"]["predicate"] == "mixed_3_6"
    own = convert(
        str(EXAMPLE), output=tmp_path / "own", quant_predicate="mixed_3_6", mtp_bits=8
    ).output
    head_bits = {v["bits"] for k, v in _quant(own).items() if k.startswith(HEAD) and v}
    assert head_bits == {8}


# nvfp4 records group size 16 at the top of config.json: safety's config validation takes it.
@pytest.mark.parametrize(
    "quant", [{"mode": "mxfp8"}, {"mode": "nvfp4"}, {"quant_predicate": "mixed_4_6"}]
)
def test_check_and_generate_read_the_result(quant: dict, tmp_path: Path) -> None:
    out = convert(str(EXAMPLE), output=tmp_path / "q", **quant).output
    result = check_checkpoint(str(out), probe=False)
    assert result["verdict"] == "pass", result["checks"]
    m = load_model(out)
    prompt = encode_prompt(m.tokenizer, "def read_config(path):")
    drafted = generate(m, prompt, max_tokens=24, depth=2, adaptive=False)
    stock_model, tokenizer = mlx_lm.load(str(out))
    reference = []
    for r in mlx_lm.stream_generate(stock_model, tokenizer, mx.array(prompt), max_tokens=24):
        if r.finish_reason == "stop":
            break
        reference.append(r.token)
    assert drafted.tokens == reference  # lossless on the quantized model
    assert drafted.accepted > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"mode": "mxfp4", "bits": 8}, "mxfp4 takes 4 bits and group size 32"),
        ({"mode": "nvfp4", "group_size": 64}, "nvfp4 takes 4 bits and group size 16"),
        ({"mode": "mxfp4", "quant_predicate": "mixed_3_6"}, "supports only --q-mode affine"),
        ({"quantize": True, "group_size": 16}, "affine quantization takes group size 32"),
    ],
)
def test_contradictory_settings_are_refused_before_reading(flags, message, tmp_path) -> None:
    with pytest.raises(MtpkitError, match=message):
        convert(str(tmp_path / "nowhere"), output=tmp_path / "out", **flags)
    assert not (tmp_path / "out").exists()
