"""The family registry and the one head class per family.

Conversion plans the head from `Family.head_module` (rooted at the head prefix, built from the
mlx-lm model's args); the runtime builds `Family.build_head` from config.json alone. Both must
be the same module: same parameter names and shapes, for every family, including a MiMo head
whose projection carries a bias. The end-to-end test converts such a checkpoint and loads it,
so the two paths meet on real files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mtpkit.convert.pipeline import convert
from mtpkit.convert.quant import build_model
from mtpkit.core.errors import MtpkitError, UnsupportedFamily
from mtpkit.families import FAMILIES, family_for, supported
from mtpkit.speculative.generate import generate, load_model
from tests.checkpoints import RAW_WITH_MTP, CheckpointFactory, add_tensor, dtype_for

# Every registered family that ships a head, by its own name; its fixture (tests/fixtures/)
# has the same name. Dense decoders (llama, qwen2, qwen3) get theirs from train-head
# (tests/test_train.py).
NAMES = sorted({cls.name for cls in FAMILIES.values() if cls.ships_head})
MIMO_BIAS = "model.mtp_layers.0.input_proj.bias"


def shapes(module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tree_flatten(module.parameters())}


def planned_and_runtime(config: dict, names: list[str]) -> tuple[dict, dict]:
    """(convert's head tree without the head prefix, the runtime head's tree)."""
    family = family_for(config)
    model = build_model(config)
    planned = shapes(family.head_module(model, 1, names))
    runtime = shapes(family.build_head(1, names))
    prefix = family.head_prefix
    assert all(k.startswith(prefix) for k in planned)
    return {k[len(prefix) :]: v for k, v in planned.items()}, runtime


def test_every_family_has_a_fixture() -> None:
    assert {"qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "mimo"} <= set(NAMES)
    assert set(NAMES) <= set(RAW_WITH_MTP)


@pytest.mark.parametrize("layout", NAMES)
def test_convert_plans_the_head_the_runtime_loads(
    checkpoint: CheckpointFactory, layout: str
) -> None:
    config = json.loads((checkpoint(layout, dtype=dtype_for(layout)) / "config.json").read_text())
    planned, runtime = planned_and_runtime(config, [])
    assert planned == runtime
    # Every role of the step is a real module of that tree.
    head = family_for(config).build_head(1)
    hidden = config.get("text_config", config)["hidden_size"]
    assert head.projection(0).weight.shape == (hidden, 2 * hidden)
    for role in (head.norm_embedding, head.norm_hidden):
        assert role(0).weight.shape == (hidden,)
    final = head.final_norm(0)
    if layout == "ernie4_5_moe":  # the lm_head reads the block output unnormed
        assert tree_flatten(final.parameters()) == []
    else:
        assert final.weight.shape == (hidden,)


@pytest.mark.parametrize("bias", [False, True])
def test_mimo_projection_bias_agrees(checkpoint: CheckpointFactory, bias: bool) -> None:
    config = json.loads((checkpoint("mimo") / "config.json").read_text())
    names = ["mtp.layers.0.input_proj.weight"] + (["mtp.layers.0.input_proj.bias"] if bias else [])
    planned, runtime = planned_and_runtime(config, names)
    assert planned == runtime
    assert ("layers.0.input_proj.bias" in runtime) == bias


def test_mimo_head_with_a_bias_converts_and_loads(
    checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    src = Path(shutil.copytree(checkpoint("mimo"), tmp_path / "src"))
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    bias = mx.arange(hidden, dtype=mx.float32).astype(mx.bfloat16) / hidden
    add_tensor(src, "model-00002-of-00002.safetensors", MIMO_BIAS, bias)
    out = tmp_path / "mlx"
    convert(str(src), output=out)
    stored = mx.load(str(out / "mtp" / "weights.safetensors"))
    assert mx.array_equal(stored["mtp.layers.0.input_proj.bias"], bias)
    m = load_model(out)
    assert mx.array_equal(m.head.projection(0).bias, bias)
    # The runtime head uses the bias: drafting stays lossless against plain decoding.
    prompt = list(range(5, 21))
    plain = generate(m, prompt, max_tokens=8, mtp=False)
    drafted = generate(m, prompt, max_tokens=8, depth=2, adaptive=False)
    assert drafted.tokens == plain.tokens and drafted.drafted > 0


def test_aliases_come_from_mlx_lm_model_remapping() -> None:
    from mlx_lm.utils import MODEL_REMAPPING

    assert MODEL_REMAPPING["kimi_k2"] == "deepseek_v3"
    assert type(family_for({"model_type": "kimi_k2"})).name == "deepseek_v3"
    assert "kimi_k2" in supported()


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedFamily, match="'gpt2' is not supported; supported: bailing_hybrid"):
        family_for({"model_type": "gpt2"})


def test_layer_offset_is_read_from_the_config() -> None:
    for layers in (3, 61, 92):
        family = family_for({"model_type": "glm4_moe", "num_hidden_layers": layers})
        assert family.rename_head(f"model.layers.{layers}.eh_proj.weight") == (
            "mtp.layers.0.eh_proj.weight"
        )
        assert not family.is_mtp_tensor(f"model.layers.{layers - 1}.eh_proj.weight")


def test_step3p5_config_lists_must_cover_the_mtp_layers(
    checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    src = Path(shutil.copytree(checkpoint("step3p5", dtype="float32"), tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    config["layer_types"] = config["layer_types"][: config["num_hidden_layers"]]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtpkitError, match="layer_types has 3 entries; the MTP layers need 5"):
        convert(str(src), output=tmp_path / "mlx")


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"mtp_hybrid_override_pattern": "*E"}, "*E"),
        ({"mtp_layers_block_type": ["attention", "moe", "mlp"]}, "*E-"),
        ({}, "*E"),  # transformers' default
    ],
)
def test_nemotron_h_mtp_pattern(fields: dict, pattern: str) -> None:
    from mtpkit.families.nemotron_h import mtp_pattern

    assert mtp_pattern(fields) == pattern


def test_nemotron_h_refuses_a_mamba_mtp_block() -> None:
    from mtpkit.families.nemotron_h import mtp_pattern

    with pytest.raises(MtpkitError, match="only attention"):
        mtp_pattern({"mtp_hybrid_override_pattern": "M*E"})
