"""Proof that the fixtures of `tests/checkpoints.py` are in the real on-disk formats.

The checks read the files with their own safetensors header parser and load the models with
stock mlx-lm, so a fixture that drifts from the published format fails here. The expected MTP
key sets are written out by hand from MTP_FORMATS.md, not derived from the builder.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model, load_tokenizer

from tests.checkpoints import (
    FAMILIES,
    MOE_LAYOUTS,
    RAW_LAYOUTS,
    RAW_WITH_MTP,
    CheckpointFactory,
    write_tokenizer,
)

RAW = RAW_LAYOUTS
MOE = MOE_LAYOUTS
EXPERTS = range(4)

# transformers warns on the `rope_scaling` field of any config it has no class for (MiMo's
# real config carries one); the field is the published format, the warning is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")


def _per_expert(prefix: str) -> set[str]:
    return {
        f"{prefix}.{e}.{p}.weight" for e in EXPERTS for p in ("gate_proj", "up_proj", "down_proj")
    }


QWEN_MTP_COMMON = {
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.input_layernorm.weight",
    "mtp.layers.0.post_attention_layernorm.weight",
    "mtp.layers.0.self_attn.q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight",
    "mtp.layers.0.self_attn.q_norm.weight",
    "mtp.layers.0.self_attn.k_norm.weight",
}
QWEN_MOE_MTP_COMMON = QWEN_MTP_COMMON | {
    "mtp.layers.0.mlp.gate.weight",
    "mtp.layers.0.mlp.shared_expert.gate_proj.weight",
    "mtp.layers.0.mlp.shared_expert.up_proj.weight",
    "mtp.layers.0.mlp.shared_expert.down_proj.weight",
    "mtp.layers.0.mlp.shared_expert_gate.weight",
}
QWEN_PER_EXPERT_MTP = QWEN_MOE_MTP_COMMON | _per_expert("mtp.layers.0.mlp.experts")


def _nextn(layer: int, attention: set[str]) -> set[str]:
    p = f"model.layers.{layer}"
    return (
        {
            f"{p}.enorm.weight",
            f"{p}.hnorm.weight",
            f"{p}.eh_proj.weight",
            f"{p}.embed_tokens.weight",
            f"{p}.shared_head.norm.weight",
            f"{p}.shared_head.head.weight",
            f"{p}.input_layernorm.weight",
            f"{p}.post_attention_layernorm.weight",
            f"{p}.mlp.gate.weight",
            f"{p}.mlp.gate.e_score_correction_bias",
            f"{p}.mlp.shared_experts.gate_proj.weight",
            f"{p}.mlp.shared_experts.up_proj.weight",
            f"{p}.mlp.shared_experts.down_proj.weight",
        }
        | {f"{p}.self_attn.{name}" for name in attention}
        | _per_expert(f"{p}.mlp.experts")
    )


MLA = {
    "q_a_proj.weight",
    "q_a_layernorm.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
}
DSA = MLA | {
    "indexer.wq_b.weight",
    "indexer.wk.weight",
    "indexer.k_norm.weight",
    "indexer.k_norm.bias",
    "indexer.weights_proj.weight",
}
GLM_ATTENTION = {
    "q_proj.weight",
    "q_proj.bias",
    "k_proj.weight",
    "k_proj.bias",
    "v_proj.weight",
    "v_proj.bias",
    "o_proj.weight",
    "q_norm.weight",
    "k_norm.weight",
}
BAILING_MLA = MLA - {"o_proj.weight"} | {"dense.weight"}


def _bailing(layer: int, attention: set[str]) -> set[str]:
    """The Bailing MTP layer (vLLM `bailing_moe_v3_mtp.py`): no embedding or head copies."""
    p = f"model.layers.{layer}"
    experts = {f"{p}.mlp.experts.{e}.{w}.weight" for e in range(8) for w in SWIGLU}
    return (
        {f"{p}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")}
        | {f"{p}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        | {f"{p}.mlp.gate.weight", f"{p}.mlp.gate.expert_bias"}
        | {f"{p}.mlp.shared_experts.{w}.weight" for w in SWIGLU}
        | {f"{p}.attention.{name}" for name in attention}
        | experts
    )


SWIGLU = ("gate_proj", "up_proj", "down_proj")
EXPECTED_MTP_KEYS: dict[str, set[str]] = {
    "bailing_moe_v3": _bailing(4, BAILING_MLA | {"g_proj.weight"}),
    "bailing_hybrid": _bailing(4, BAILING_MLA),
    "qwen3_5": QWEN_MTP_COMMON
    | {f"mtp.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
    "qwen3_5_moe": QWEN_PER_EXPERT_MTP,
    "qwen3_6_moe": QWEN_MOE_MTP_COMMON
    | {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"},
    "qwen3_next": QWEN_PER_EXPERT_MTP,
    "deepseek_v3": _nextn(2, MLA),
    "glm4_moe": _nextn(3, GLM_ATTENTION),
    "glm4_moe_lite": _nextn(2, MLA),
    "deepseek_v32": _nextn(2, DSA),
    "glm_moe_dsa": _nextn(3, DSA),
    "longcat_flash": {"model.mtp.embed_tokens.weight", "model.mtp.norm.weight"}
    | {
        f"model.mtp.layers.0.{name}"
        for name in (
            "eh_proj.weight",
            "enorm.m.weight",
            "hnorm.m.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "transformer_layer.mlp.gate_proj.weight",
            "transformer_layer.mlp.up_proj.weight",
            "transformer_layer.mlp.down_proj.weight",
        )
    }
    | {f"model.mtp.layers.0.self_attn.{name}" for name in MLA},
    "mimo": {
        f"model.mtp_layers.0.{name}"
        for name in (
            "token_layernorm.weight",
            "hidden_layernorm.weight",
            "input_proj.weight",
            "final_layernorm.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    },
    # baidu/ERNIE-4.5-21B-A3B-PT: one role list per name, the block a dense decoder layer.
    "ernie4_5_moe": {
        "model.mtp_emb_norm.0.weight",
        "model.mtp_hidden_norm.0.weight",
        "model.mtp_linear_proj.0.weight",
    }
    | {
        f"model.mtp_block.0.{name}"
        for name in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    },
    # K-EXAONE: Qwen-style names; vLLM's is_mtp layer has the dense MLP.
    "exaone_moe": {
        f"mtp.{name}"
        for name in (
            "fc.weight",
            "pre_fc_norm_embedding.weight",
            "pre_fc_norm_hidden.weight",
            "norm.weight",
            "layers.0.input_layernorm.weight",
            "layers.0.post_attention_layernorm.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.self_attn.q_norm.weight",
            "layers.0.self_attn.k_norm.weight",
            "layers.0.mlp.gate_proj.weight",
            "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight",
        )
    },
    # MiMo-V2-Flash: three nextn layers, each a sliding-window block with a sink.
    "mimo_v2_flash": {
        f"model.mtp.layers.{i}.{name}"
        for i in range(3)
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "final_layernorm.weight",
            "input_layernorm.weight",
            "pre_mlp_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.attention_sink_bias",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    },
    # Step-3.5: nextn layers N, N+1 with a dense block, the gate `g_proj`, and the lm_head's
    # copy `transformer.shared_head.output`.
    "step3p5": {
        f"model.layers.{layer}.{name}"
        for layer in (3, 4)
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "transformer.shared_head.norm.weight",
            "transformer.shared_head.output.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.g_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    },
    # Nemotron 3 Super: one MTP layer of two blocks ("*E"), the latent MoE per expert.
    "nemotron_h": {
        f"mtp.layers.0.{name}"
        for name in (
            "enorm.weight",
            "hnorm.weight",
            "eh_proj.weight",
            "norm.weight",
            "mixer.q_proj.weight",
            "mixer.k_proj.weight",
            "mixer.v_proj.weight",
            "mixer.o_proj.weight",
        )
    }
    | {
        f"mtp.layers.1.{name}"
        for name in (
            "norm.weight",
            "final_layernorm.weight",
            "mixer.gate.weight",
            "mixer.gate.e_score_correction_bias",
            "mixer.shared_experts.up_proj.weight",
            "mixer.shared_experts.down_proj.weight",
            "mixer.fc1_latent_proj.weight",
            "mixer.fc2_latent_proj.weight",
        )
    }
    | {
        f"mtp.layers.1.mixer.experts.{e}.{p}.weight"
        for e in range(4)
        for p in ("up_proj", "down_proj")
    },
    "stripped": set(),
}
EXPECTED_MTP_COUNTS = {
    "bailing_moe_v3": 43,
    "bailing_hybrid": 42,
    "qwen3_5": 15,
    "qwen3_5_moe": 29,
    "qwen3_6_moe": 19,
    "qwen3_next": 29,
    "deepseek_v3": 32,
    "glm4_moe": 34,
    "glm4_moe_lite": 32,
    "deepseek_v32": 37,
    "glm_moe_dsa": 37,
    "longcat_flash": 17,
    "mimo": 16,
    "ernie4_5_moe": 12,
    "exaone_moe": 15,
    "mimo_v2_flash": 42,
    "step3p5": 34,
    "nemotron_h": 24,
    "stripped": 0,
}


# --------------------------------------------------------------------------- helpers


def read_safetensors(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, str], bytes]:
    """Header entries, `__metadata__` and the data section of one safetensors file."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    metadata = header.pop("__metadata__", {})
    return header, metadata, raw[8 + header_len :]


def shard_files(path: Path) -> list[Path]:
    return sorted(path.glob("model-*-of-*.safetensors"))


def tensor_bytes(path: Path) -> dict[str, bytes]:
    """Raw bytes of every tensor in a checkpoint directory."""
    out: dict[str, bytes] = {}
    for shard in shard_files(path):
        header, _, data = read_safetensors(shard)
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            out[name] = data[start:end]
    return out


def is_mtp_key(layout: str, name: str, config: dict[str, Any]) -> bool:
    if layout in (
        "deepseek_v3",
        "glm4_moe",
        "glm4_moe_lite",
        "deepseek_v32",
        "glm_moe_dsa",
        "step3p5",
        "bailing_moe_v3",
        "bailing_hybrid",
    ):
        # Every layer from num_hidden_layers on (Step-3.5 keeps several).
        parts = name.split(".")
        return name.startswith("model.layers.") and int(parts[2]) >= config["num_hidden_layers"]
    if layout == "mimo":
        return name.startswith("model.mtp_layers.")
    if layout in ("longcat_flash", "mimo_v2_flash"):
        return name.startswith("model.mtp.")
    if layout == "ernie4_5_moe":
        return name.startswith("model.mtp_")
    if layout == "mlx_inline":
        return name.startswith("language_model.mtp.")
    return name.startswith("mtp.")


def run_forward(model: Any, tokens: list[int]) -> mx.array:
    logits = model(mx.array([tokens]))
    mx.eval(logits)
    return logits


Builder = CheckpointFactory


@pytest.fixture(scope="module")
def built(checkpoint: CheckpointFactory) -> Builder:
    """The session's checkpoint factory (`conftest.checkpoint`)."""
    return checkpoint


# --------------------------------------------------------------------------- stock mlx-lm


def test_families_are_the_documented_layouts() -> None:
    assert FAMILIES == (
        "bailing_hybrid",
        "bailing_moe_v3",
        "deepseek_v3",
        "deepseek_v32",
        "ernie4_5_moe",
        "exaone_moe",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "longcat_flash",
        "mimo",
        "mimo_v2_flash",
        "nemotron_h",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_6_moe",
        "qwen3_next",
        "step3p5",
        "stripped",
        "mlx_inline",
        "mlx_plain",
    )


@pytest.mark.parametrize("layout", RAW)
def test_stock_mlx_lm_loads_and_runs_the_backbone(built: Builder, layout: str) -> None:
    # DeepSeek-V3's stock sanitize drops only the literal `model.layers.61`, so the tiny
    # nextn layer (model.layers.2) is left over and strict loading refuses it (tested below);
    # its backbone is proven on the bit-identical twin without MTP.
    with_mtp = layout != "deepseek_v3"
    path = built(layout, dtype="float32" if layout in MOE else "bfloat16", with_mtp=with_mtp)
    model, tokenizer = mlx_lm_load(str(path))
    tokens = tokenizer.encode("hello world")
    logits = run_forward(model, tokens)
    assert logits.shape == (1, len(tokens), 512)
    assert mx.isfinite(logits).all().item()


def test_stock_deepseek_v3_refuses_a_nextn_layer_that_is_not_61(built: Builder) -> None:
    path = built("deepseek_v3", dtype="float32")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.eh_proj\.weight"):
        load_model(path)


@pytest.mark.parametrize("layout", ["mlx_inline", "mlx_plain"])
def test_stock_mlx_lm_loads_and_runs_the_mlx_layouts(built: Builder, layout: str) -> None:
    model, tokenizer = mlx_lm_load(str(built(layout)))
    tokens = tokenizer.encode("hello world")
    logits = run_forward(model, tokens)
    assert logits.shape == (1, len(tokens), 512)
    assert mx.isfinite(logits).all().item()


# --------------------------------------------------------------------------- files and index


@pytest.mark.parametrize("layout", FAMILIES)
def test_index_matches_the_shards(built: Builder, layout: str) -> None:
    path = built(layout)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = shard_files(path)
    assert [f.name for f in files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    weight_map: dict[str, str] = {}
    total = 0
    for shard in files:
        header, metadata, data = read_safetensors(shard)
        assert metadata == {"format": "mlx" if layout.startswith("mlx") else "pt"}
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            total += end - start
            weight_map[name] = shard.name
        assert max(e["data_offsets"][1] for e in header.values()) == len(data)
    assert index["metadata"]["total_size"] == total
    assert index["weight_map"] == weight_map


@pytest.mark.parametrize("layout", RAW)
def test_mtp_keys_are_exactly_the_published_set(built: Builder, layout: str) -> None:
    path = built(layout)
    config = json.loads((path / "config.json").read_text())
    names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    mtp = {n for n in names if is_mtp_key(layout, n, config)}
    assert mtp == EXPECTED_MTP_KEYS[layout]
    assert len(mtp) == EXPECTED_MTP_COUNTS[layout]


@pytest.mark.parametrize("layout", [*RAW_WITH_MTP, "mlx_inline"])
def test_mtp_tensors_sit_in_the_last_shard_beside_backbone_ones(
    built: Builder, layout: str
) -> None:
    path = built(layout)
    config = json.loads((path / "config.json").read_text())
    *first, last = shard_files(path)
    last_names = set(read_safetensors(last)[0])
    mtp = {n for n in last_names if is_mtp_key(layout, n, config)}
    assert mtp and last_names - mtp
    for shard in first:
        assert not any(is_mtp_key(layout, n, config) for n in read_safetensors(shard)[0])


@pytest.mark.parametrize("layout", RAW_WITH_MTP)
def test_twin_without_mtp_has_a_bit_identical_backbone(built: Builder, layout: str) -> None:
    path, twin = built(layout), built(layout, with_mtp=False)
    config = json.loads((path / "config.json").read_text())
    full, bare = tensor_bytes(path), tensor_bytes(twin)
    assert set(bare) == {n for n in full if not is_mtp_key(layout, n, config)}
    assert all(bare[n] == full[n] for n in bare)
    assert json.loads((twin / "config.json").read_text()) == config
    for a, b in zip(shard_files(path)[:-1], shard_files(twin)[:-1], strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_seed_decides_the_weights(built: Builder) -> None:
    same = tensor_bytes(built("mimo"))
    again = tensor_bytes(built("mimo", shards=2, seed=0))
    other = tensor_bytes(built("mimo", seed=1))
    assert same == again
    assert same["lm_head.weight"] != other["lm_head.weight"]


def test_shard_count_and_vocab_size_follow_the_arguments(built: Builder) -> None:
    path = built("glm4_moe", shards=3, vocab_size=300)
    assert [f.name for f in shard_files(path)] == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    header, _, _ = read_safetensors(shard_files(path)[0])
    assert header["model.embed_tokens.weight"]["shape"] == [300, 64]
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 300
    tokenizer = load_tokenizer(path)
    assert len(tokenizer._tokenizer) <= 300


# --------------------------------------------------------------------------- formats


def test_qwen3_5_config_and_tensor_layout(built: Builder) -> None:
    path = built("qwen3_5")
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    assert (config["model_type"], text["model_type"]) == ("qwen3_5", "qwen3_5_text")
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["mtp_num_hidden_layers"] == 1 and text["tie_word_embeddings"] is False
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (
        text["rope_parameters"]["mrope_section"]
        and "partial_rotary_factor" in text["rope_parameters"]
    )
    headers: dict[str, dict[str, Any]] = {}
    for shard in shard_files(path):
        headers |= read_safetensors(shard)[0]
    assert all(e["dtype"] == "BF16" for e in headers.values())
    assert headers["model.language_model.layers.0.linear_attn.conv1d.weight"]["shape"] == [
        128,
        1,
        4,
    ]
    assert headers["mtp.fc.weight"]["shape"] == [64, 128]
    # Gated attention: q_proj yields queries and the output gate.
    assert headers["mtp.layers.0.self_attn.q_proj.weight"]["shape"] == [256, 64]
    assert "lm_head.weight" in headers
    assert not any(n.startswith("model.layers.") for n in headers)


def test_qwen_norm_conventions(built: Builder) -> None:
    weights = mx.load(str(shard_files(built("qwen3_5", dtype="float32"))[0]))
    weights |= mx.load(str(shard_files(built("qwen3_5", dtype="float32"))[1]))
    zero_centred = weights["model.language_model.layers.0.input_layernorm.weight"]
    gated = weights["model.language_model.layers.0.linear_attn.norm.weight"]
    assert abs(mx.mean(zero_centred).item()) < 0.1
    assert abs(mx.mean(gated).item() - 1.0) < 0.1
    assert abs(mx.mean(weights["mtp.pre_fc_norm_hidden.weight"]).item()) < 0.1


def test_qwen_moe_expert_layouts(built: Builder) -> None:
    for layout, mtp_gate_up in (
        ("qwen3_5_moe", "mtp.layers.0.mlp.experts.3.gate_proj.weight"),
        ("qwen3_6_moe", "mtp.layers.0.mlp.experts.gate_up_proj"),
    ):
        path = built(layout)
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == "qwen3_5_moe"
        assert config["text_config"]["model_type"] == "qwen3_5_moe_text"
        headers = (
            read_safetensors(shard_files(path)[-1])[0] | read_safetensors(shard_files(path)[0])[0]
        )
        assert headers["model.language_model.layers.1.mlp.experts.gate_up_proj"]["shape"] == [
            4,
            128,
            64,
        ]
        assert headers["model.language_model.layers.1.mlp.experts.down_proj"]["shape"] == [
            4,
            64,
            64,
        ]
        assert mtp_gate_up in headers
    fused = read_safetensors(shard_files(built("qwen3_6_moe"))[-1])[0]
    assert fused["mtp.layers.0.mlp.experts.gate_up_proj"]["shape"] == [4, 128, 64]
    assert fused["mtp.layers.0.mlp.experts.down_proj"]["shape"] == [4, 64, 64]


def test_qwen3_next_config_declares_no_mtp(built: Builder) -> None:
    path = built("qwen3_next")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_next" and "text_config" not in config
    assert not any("mtp" in key or "nextn" in key for key in config)
    names = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names


@pytest.mark.parametrize("layout", ["deepseek_v3", "glm4_moe"])
def test_nextn_layer_duplicates_are_byte_identical(built: Builder, layout: str) -> None:
    path = built(layout)
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["first_k_dense_replace"] == 1
    layer = config["num_hidden_layers"]
    tensors = tensor_bytes(path)
    assert (
        tensors[f"model.layers.{layer}.embed_tokens.weight"] == tensors["model.embed_tokens.weight"]
    )
    assert tensors[f"model.layers.{layer}.shared_head.head.weight"] == tensors["lm_head.weight"]
    header = read_safetensors(shard_files(path)[-1])[0]
    assert header[f"model.layers.{layer}.eh_proj.weight"]["shape"] == [64, 128]
    # transformers keeps the router bias in float32 (`_keep_in_fp32_modules_strict`).
    assert header[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    assert header[f"model.layers.{layer}.input_layernorm.weight"]["dtype"] == "BF16"
    assert "model.layers.0.mlp.gate_proj.weight" in tensors  # dense first layer
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in tensors


def test_mimo_mtp_layer(built: Builder) -> None:
    path = built("mimo")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mimo" and config["num_nextn_predict_layers"] == 1
    header = read_safetensors(shard_files(path)[-1])[0]
    assert header["model.mtp_layers.0.input_proj.weight"]["shape"] == [64, 128]
    assert header["model.mtp_layers.0.self_attn.k_proj.bias"]["shape"] == [32]


def test_stripped_declares_mtp_without_tensors(built: Builder) -> None:
    path = built("stripped")
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert tensor_bytes(path) == tensor_bytes(built("qwen3_5", with_mtp=False))


# --------------------------------------------------------------------------- MLX layouts


def test_mlx_inline_holds_a_stacked_shifted_quantized_head(built: Builder) -> None:
    path = built("mlx_inline")
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    quantization = config["quantization"]
    assert (quantization["group_size"], quantization["bits"], quantization["mode"]) == (
        64,
        4,
        "affine",
    )
    for router in ("mlp.gate", "mlp.shared_expert_gate"):
        assert quantization[f"language_model.mtp.layers.0.{router}"] == {
            "group_size": 64,
            "bits": 8,
        }
    assert config["quantization_config"] == quantization

    last = shard_files(path)[-1]
    assert last.name.startswith("model-")
    weights = mx.load(str(last))
    switch = "language_model.mtp.layers.0.mlp.switch_mlp"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert {f"{switch}.{proj}.{p}" for p in ("weight", "scales", "biases")} <= set(weights)
        assert weights[f"{switch}.{proj}.weight"].dtype == mx.uint32
        assert weights[f"{switch}.{proj}.weight"].shape[0] == 4
    assert weights["language_model.mtp.fc.scales"].dtype == mx.bfloat16
    assert not any(".experts." in n for n in weights)

    # Against the raw head of the same seed: experts stacked in order, norms shifted by +1.
    raw: dict[str, mx.array] = {}
    for shard in shard_files(built("qwen3_5_moe", dtype="float32")):
        raw |= mx.load(str(shard))
    gate = mx.dequantize(
        weights[f"{switch}.gate_proj.weight"],
        weights[f"{switch}.gate_proj.scales"],
        weights[f"{switch}.gate_proj.biases"],
        group_size=64,
        bits=4,
    ).astype(mx.float32)
    expected = mx.stack([raw[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in EXPERTS])
    assert mx.abs(gate - expected).max().item() < 0.02
    for norm in ("mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_norm.weight"):
        shifted = weights[f"language_model.{norm}"].astype(mx.float32)
        assert mx.allclose(shifted, raw[norm] + 1.0, atol=1e-2).item()


def test_mlx_backbone_is_in_mlx_layout(built: Builder) -> None:
    for layout in ("mlx_inline", "mlx_plain"):
        weights: dict[str, mx.array] = {}
        for shard in shard_files(built(layout)):
            weights |= mx.load(str(shard))
        conv = weights["language_model.model.layers.0.linear_attn.conv1d.weight"]
        assert conv.shape == (128, 4, 1)
        norm = weights["language_model.model.layers.0.input_layernorm.weight"]
        assert abs(mx.mean(norm.astype(mx.float32)).item() - 1.0) < 0.1
        assert "language_model.lm_head.scales" in weights


def test_mlx_plain_is_stock_and_stripped(built: Builder) -> None:
    path = built("mlx_plain")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("mtp" in n for n in names)
    assert all(n.startswith("language_model.") for n in names)


def test_mlx_inline_without_mtp_matches_plain_moe_backbone(built: Builder) -> None:
    full, bare = (
        tensor_bytes(built("mlx_inline")),
        tensor_bytes(built("mlx_inline", with_mtp=False)),
    )
    assert set(bare) == {n for n in full if not n.startswith("language_model.mtp.")}
    assert all(bare[n] == full[n] for n in bare)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_in_transformers_and_mlx_lm(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode("hello world")
    assert tokenizer.decode(ids) == "hello world"
    assert len(tokenizer) <= 512
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
    ]
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    wrapped = load_tokenizer(tmp_path)
    assert wrapped.decode(wrapped.encode("hello world")) == "hello world"
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]


@pytest.mark.parametrize("layout", FAMILIES)
def test_every_layout_ships_a_loadable_tokenizer(built: Builder, layout: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built(layout))
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    config_vocab = json.loads((built(layout) / "config.json").read_text())
    vocab = config_vocab.get("text_config", config_vocab)["vocab_size"]
    assert np.max(tokenizer.encode("<|im_end|> hello")) < vocab
