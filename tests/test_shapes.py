"""`mtpkit bench --random`'s builder: a model of each table shape that stock mlx-lm loads.

Each shape is built scaled down (narrower, four layers, a small vocabulary and, for the MoE
shape, fewer experts) so the test is quick; everything else (layer pattern, MoE routing,
tied or separate lm_head, quantization, scale dtype, the MTP sidecar) is the table's. The
Qwen3 dense shapes (no head, a random DFlash drafter) are tests/test_block_bench.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.bench.shapes import SHAPES, build_random_model, has_head
from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"

SMALL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "vocab_size": 1024,
    "rope_parameters": SHAPES["qwen3_5-0.8b"]["rope_parameters"] | {"mrope_section": [3, 3, 2]},
}
SMALL_MOE = {"num_experts": 8, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [(s, "bfloat16" if i % 2 else "float32") for i, s in enumerate(filter(has_head, SHAPES))],
)
def test_random_model_of_each_shape_loads_and_decodes(
    shape: str, dtype: str, tmp_path: Path
) -> None:
    overrides = dict(SMALL) | (SMALL_MOE if "num_experts" in SHAPES[shape] else {})
    path = build_random_model(
        shape, tmp_path / shape, dtype=dtype, tokenizer_from=EXAMPLE, overrides=overrides
    )
    config = json.loads((path / "config.json").read_text())
    text = config["text_config"]
    for key, value in SHAPES[shape].items():  # the table's, where not scaled down
        assert text[key] == overrides.get(key, value), key
    assert config["quantization"]["bits"] == 4

    stock, tokenizer = mlx_lm.load(str(path))
    layers = stock.language_model.model.layers
    assert len(layers) == 4
    assert [layer.is_linear for layer in layers] == [True, True, True, False]
    moe = "num_experts" in SHAPES[shape]
    assert all(hasattr(layer.mlp, "switch_mlp") == moe for layer in layers)
    # quantized, with scales of the chosen dtype
    scales = [v for k, v in _flat(stock) if k.endswith(".scales")]
    assert scales and all(s.dtype == getattr(mx, dtype) for s in scales)
    assert ("lm_head" in stock.language_model) != SHAPES[shape]["tie_word_embeddings"]

    # mtpkit finds the head, and MTP decoding reproduces stock greedy decoding.
    m = load_model(path)
    assert m.head is not None
    prompt = tokenizer.encode("def add(a, b):")
    expected = [r.token for r in mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=6)]
    m.tokenizer.eos_token_ids = []
    decoder = MtpDecoder(m, prompt, depth=2, sampling=SamplingSettings(), adaptive=False)
    assert list(decoder.tokens(len(expected))) == expected
    assert decoder.stats.rounds > 0


def _flat(model) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())
