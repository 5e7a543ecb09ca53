"""`mtpkit check` on the new families: a head with real skill passes, a foreign one fails.

A random head is never accepted, so each family gets a checkpoint whose head is skilled by
construction: the trunk's attention and MLP outputs are zeroed (every layer passes the
embedding through, so the trunk is a bigram model whose untied lm_head maps token t to a
fixed permutation of t), and the head's block is zeroed the same way with a projection that
keeps only the normed embedding of t_{k+1}. The head then predicts exactly what the trunk
will say after t_{k+1}: every greedy draft is right. Swapping the projection's halves or
drawing the head's matrices at random takes that skill away, and `check` must say so.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit.check.verdict import check_checkpoint
from mtpkit.convert.pipeline import convert
from mtpkit.core.prompts import BUILTIN_PROMPTS
from tests.checkpoints import CheckpointFactory, add_tensor

MAX_TOKENS = 16
# A head with no skill makes check try every variant on more prompts: shorter generations.
FAILING_MAX_TOKENS = 8
HEAD = Path("mtp") / "weights.safetensors"
LAST = "model-00002-of-00002.safetensors"
# Tensors whose zeroing makes a residual layer pass its input through.
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight")


def ernie_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """ERNIE's head: emb_norm copies the trunk's final norm, the projection keeps the
    embedding half, and no norm follows the block: logits = lm_head(norm(embed(t_{k+1})))."""
    h = tensors["model.embed_tokens.weight"].shape[1]
    tensors["model.mtp_emb_norm.0.weight"] = tensors["model.norm.weight"]
    eye = mx.eye(h, dtype=mx.float32)
    tensors["model.mtp_linear_proj.0.weight"] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    return tensors


def exaone_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """EXAONE's head: unit embedding norm, fc keeps the embedding half, and the head's final
    norm copies the trunk's: logits = lm_head(norm(norm(embed(t_{k+1}))))."""
    h = tensors["model.embed_tokens.weight"].shape[1]
    tensors["mtp.pre_fc_norm_embedding.weight"] = mx.ones((h,))
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"]
    eye = mx.eye(h, dtype=mx.float32)
    tensors["mtp.fc.weight"] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    return tensors


def mimo_v2_flash_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """MiMo-V2-Flash's three layers alike: unit enorm, eh_proj keeps the embedding half, and
    final_layernorm copies the trunk's norm: logits = lm_head(norm(norm(embed(t_{k+1}))))."""
    h = tensors["model.embed_tokens.weight"].shape[1]
    eye = mx.eye(h, dtype=mx.float32)
    layers = {k.split(".")[3] for k in tensors if k.startswith("model.mtp.layers.")}
    for i in layers:
        tensors[f"model.mtp.layers.{i}.enorm.weight"] = mx.ones((h,))
        tensors[f"model.mtp.layers.{i}.final_layernorm.weight"] = tensors["model.norm.weight"]
        tensors[f"model.mtp.layers.{i}.eh_proj.weight"] = mx.concatenate(
            [eye, mx.zeros_like(eye)], axis=1
        )
    return tensors


def step3p5_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Step-3.5's nextn layers: zero-centred, so a zero enorm is the unit one; eh_proj keeps
    the embedding half and shared_head.norm copies the trunk's norm."""
    h = tensors["model.embed_tokens.weight"].shape[1]
    eye = mx.eye(h, dtype=mx.float32)
    for name in [k for k in tensors if k.endswith(".eh_proj.weight")]:
        layer = name.removesuffix("eh_proj.weight")
        tensors[f"{layer}enorm.weight"] = mx.zeros((h,))
        tensors[f"{layer}transformer.shared_head.norm.weight"] = tensors["model.norm.weight"]
        tensors[name] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    return tensors


def nemotron_h_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Nemotron-H: the Mamba-2 mixers pass through too (zero `out_proj`); the step's first
    block has a unit enorm and an eh_proj that keeps the embedding half, its last block's
    final_layernorm copies the trunk's `norm_f`."""
    h = tensors["backbone.embeddings.weight"].shape[1]
    for name in [k for k in tensors if k.endswith("mixer.out_proj.weight")]:
        tensors[name] = mx.zeros_like(tensors[name])
    eye = mx.eye(h, dtype=mx.float32)
    tensors["mtp.layers.0.enorm.weight"] = mx.ones((h,))
    tensors["mtp.layers.0.eh_proj.weight"] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    last = max(k for k in tensors if k.endswith(".final_layernorm.weight"))
    tensors[last] = tensors["backbone.norm_f.weight"]
    return tensors


def nextn_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """DeepSeek-style nextn layers (GLM-4.7-Flash, DeepSeek-V3.2, GLM-5; MLA blocks, the DSA
    indexer's output also ends in o_proj): unit enorm, eh_proj keeps the embedding half,
    shared_head.norm copies the trunk's norm."""
    h = tensors["model.embed_tokens.weight"].shape[1]
    eye = mx.eye(h, dtype=mx.float32)
    for name in [k for k in tensors if k.endswith(".eh_proj.weight")]:
        layer = name.removesuffix("eh_proj.weight")
        tensors[f"{layer}enorm.weight"] = mx.ones((h,))
        tensors[f"{layer}shared_head.norm.weight"] = tensors["model.norm.weight"]
        tensors[name] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    return tensors


def longcat_skilled(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """LongCat-Flash's `model.mtp`: unit enorm.m, eh_proj keeps the embedding half, the head's
    final norm copies the trunk's."""
    h = tensors["model.embed_tokens.weight"].shape[1]
    eye = mx.eye(h, dtype=mx.float32)
    tensors["model.mtp.layers.0.enorm.m.weight"] = mx.ones((h,))
    tensors["model.mtp.norm.weight"] = tensors["model.norm.weight"]
    tensors["model.mtp.layers.0.eh_proj.weight"] = mx.concatenate([eye, mx.zeros_like(eye)], axis=1)
    return tensors


SKILLED: dict[str, Callable[[dict[str, mx.array]], dict[str, mx.array]]] = {
    "glm4_moe_lite": nextn_skilled,
    "deepseek_v32": nextn_skilled,
    "glm_moe_dsa": nextn_skilled,
    "longcat_flash": longcat_skilled,
    "ernie4_5_moe": ernie_skilled,
    "exaone_moe": exaone_skilled,
    "mimo_v2_flash": mimo_v2_flash_skilled,
    "step3p5": step3p5_skilled,
    "nemotron_h": nemotron_h_skilled,
}
# The token embedding's name in each family's raw checkpoint.
EMBEDDINGS = ("model.embed_tokens.weight", "backbone.embeddings.weight")
# These heads step through MtpHead.__call__ as ERNIE's, EXAONE's, MiMo-V2's and GLM-4.7-Flash's
# do; their swapped-projection runs (slow here) add nothing those do not prove.
SHARED_CONCAT = ("step3p5", "deepseek_v32", "glm_moe_dsa")
# The projection's name in each family's converted head.
PROJECTIONS = ("linear_proj.weight", "mtp.fc.weight", "eh_proj.weight")


def skilled_checkpoint(src: Path, dst: Path, layout: str) -> Path:
    shutil.copytree(src, dst)
    shards = {s: dict(mx.load(str(s))) for s in sorted(dst.glob("model-*.safetensors"))}
    tensors = {k: v for part in shards.values() for k, v in part.items()}
    tensors = {
        k: mx.zeros_like(v) if k.endswith(OUTPUT_PROJECTIONS) else v for k, v in tensors.items()
    }
    tensors = SKILLED[layout](tensors)
    # An untied lm_head that maps t to perm[t]: the trunk does not just repeat its input.
    embed = tensors[next(k for k in EMBEDDINGS if k in tensors)]
    perm = np.random.default_rng(0).permutation(embed.shape[0])
    lm_head = embed[mx.array(np.argsort(perm))]
    tied = "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = lm_head
    for shard, part in shards.items():
        mx.save_safetensors(str(shard), {k: tensors[k] for k in part}, metadata={"format": "pt"})
    if tied:
        add_tensor(dst, LAST, "lm_head.weight", lm_head)
        config = json.loads((dst / "config.json").read_text())
        config["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def edit_head(path: Path, edit: Callable[[dict[str, mx.array]], dict[str, mx.array]]) -> Path:
    weights = dict(mx.load(str(path / HEAD)))
    mx.save_safetensors(str(path / HEAD), edit(weights), metadata={"format": "mlx"})
    return path


def foreign(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Same shapes and scale, other weights: a head of another model of this architecture."""
    mx.random.seed(1234)
    return {
        k: (mx.random.normal(v.shape) * mx.std(v).item()).astype(v.dtype) if v.ndim >= 2 else v
        for k, v in weights.items()
    }


def swapped(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Every projection's two halves exchanged: the head reads the hidden state as the
    embedding."""
    out = dict(weights)
    for name in (k for k in weights if k.endswith(PROJECTIONS)):
        w = weights[name]
        half = w.shape[1] // 2
        out[name] = mx.concatenate([w[:, half:], w[:, :half]], axis=1)
    return out


@pytest.fixture(scope="module", params=sorted(SKILLED))
def skilled(request, checkpoint: CheckpointFactory, tmp_path_factory) -> tuple[str, Path]:
    layout = request.param
    root = tmp_path_factory.mktemp(f"check-{layout}")
    src = skilled_checkpoint(checkpoint(layout, dtype="float32"), root / "src", layout)
    out = root / "mlx"
    convert(str(src), output=out)
    return layout, out


def statuses(result: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in result["checks"]}


def test_skilled_head_passes(skilled) -> None:
    _, out = skilled
    result = check_checkpoint(str(out), max_tokens=MAX_TOKENS)
    assert result["verdict"] == "pass", result["checks"]
    assert result["acceptance"] >= 0.9


def test_foreign_head_fails(skilled, tmp_path: Path) -> None:
    _, out = skilled
    damaged = edit_head(Path(shutil.copytree(out, tmp_path / "foreign")), foreign)
    # A foreign head keeps no draft on any prompt: four of them show it (check tries every
    # variant on each, so the built-in sixteen would take four times as long for nothing).
    result = check_checkpoint(
        str(damaged), prompts=BUILTIN_PROMPTS[:4], max_tokens=FAILING_MAX_TOKENS
    )
    assert result["verdict"] == "fail"
    assert statuses(result)["head_matches_trunk"] == "fail", result["checks"]


def test_swapped_projection_fails_concat_order(skilled, tmp_path: Path) -> None:
    layout, out = skilled
    if layout in SHARED_CONCAT:
        pytest.skip(f"{layout} concatenates in MtpHead.__call__, proven on the other families")
    damaged = edit_head(Path(shutil.copytree(out, tmp_path / "swapped")), swapped)
    # Swapped halves keep no draft, the swap back keeps nearly all: six prompts decide it.
    result = check_checkpoint(str(damaged), prompts=BUILTIN_PROMPTS[:6], max_tokens=MAX_TOKENS)
    assert result["verdict"] == "fail"
    assert statuses(result)["concat_order"] == "fail", result["checks"]
    assert result["best_variant"]["concat_order"] == "hidden_first"
