"""Each family's MLX head against an independent float32 numpy forward of its MTP step.

The numpy side (`tests/references/numpy_blocks.py`) reads the raw checkpoint's own tensor
names and is written from vLLM's equations; the MLX side is the head mtpkit's runtime loads
from the converted directory, run through the same calls `mtpkit generate` makes.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit.convert.pipeline import convert
from mtpkit.runtime.model import load_model
from tests.checkpoints import CheckpointFactory
from tests.references import numpy_blocks

REFERENCES = {
    "ernie4_5_moe": numpy_blocks.ernie_mtp_logits,
    "exaone_moe": numpy_blocks.exaone_mtp_logits,
    "mimo_v2_flash": numpy_blocks.mimo_v2_flash_mtp_logits,
    "step3p5": numpy_blocks.step3p5_mtp_logits,
    "nemotron_h": numpy_blocks.nemotron_h_mtp_logits,
}


def raw_weights(path: Path) -> dict[str, np.ndarray]:
    weights: dict[str, np.ndarray] = {}
    for shard in sorted(path.glob("model*.safetensors")):
        weights |= {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(shard)).items()}
    return weights


@pytest.mark.parametrize("layout", sorted(REFERENCES))
def test_head_logits_match_numpy_reference(
    checkpoint: CheckpointFactory, tmp_path: Path, layout: str
) -> None:
    src = checkpoint(layout, dtype="float32")
    out = tmp_path / "mlx"
    convert(str(src), output=out)
    m = load_model(out)
    config = json.loads((src / "config.json").read_text())
    rng = np.random.default_rng(0)
    seq = 12  # past the sliding windows (8) of the EXAONE, MiMo-V2 and Step-3.5 fixtures
    hidden = rng.normal(0.0, 1.0, size=(seq, config["hidden_size"])).astype(np.float32)
    tokens = rng.integers(3, config["vocab_size"], size=seq)

    weights = raw_weights(src)
    steps = getattr(m.head, "num_steps", len(m.head.layers))  # Nemotron-H: blocks per step
    for layer in range(steps):  # depth d drafts with layer d % num_layers
        x = m.head(mx.array(hidden)[None], m.embed(mx.array(tokens)[None]), step=layer)
        got = np.array(m.lm_head(m.head.final_norm(layer)(x))[0])
        want = REFERENCES[layout](weights, config, hidden, tokens, layer)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
