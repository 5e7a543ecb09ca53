"""The MLA families: GLM-4.7-Flash, DeepSeek-V3.2, GLM-5 (DeepSeek's nextn layer) and
LongCat-Flash (`model.mtp.*`).

Each family's tiny checkpoint (tests/fixtures/<model_type>.py, the published layout) goes
through every stage: inspect finds the head; convert's backbone equals stock
`mlx_lm.convert`'s (loaded by stock `mlx_lm.load`, parameters and logits bit for bit); the
converted head's logits equal a float32 numpy forward of the family's MTP step written from
vLLM's equations (tests/mtp_reference.py); greedy `generate --mtp` equals plain decoding,
also when drafts are accepted part of the way; `check` passes the healthy head and fails a
damaged one. MoE layers run in float32 (MLX's CPU GatherMM is float32-only).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtpkit.check.verdict import check_checkpoint
from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.convert.pipeline import convert
from mtpkit.families import family_for
from mtpkit.speculative.generate import MtpDecoder, SamplingSettings, generate, load_model
from tests.checkpoints import CheckpointFactory
from tests.injected import accepted_per_round, inject_drafts, planned_per_round
from tests.mtp_reference import load_raw, longcat_logits, nextn_logits

LAYOUTS = ("glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "longcat_flash")
# layout -> (where the raw head sits, its expert layout, the layers its config declares)
HEADS = {
    "glm4_moe_lite": ("nextn", "per_expert", 1),
    "deepseek_v32": ("nextn", "per_expert", 1),
    "glm_moe_dsa": ("nextn", "per_expert", 1),
    # One dense MTP layer; the published config has no MTP field (vLLM builds one layer).
    "longcat_flash": ("model.mtp.", "dense", None),
}
REFERENCE = {"nextn": nextn_logits, "model.mtp.": longcat_logits}
# Longer than the fixtures' index_topk (8), so DSA's sparse selection is at work.
PROMPT = [5, 17, 100, 3, 250, 42, 7, 9, 300, 11, 64, 128, 77, 21]


@pytest.fixture(scope="module")
def raw(checkpoint: CheckpointFactory):
    return lambda layout: checkpoint(layout, dtype="float32")


@pytest.fixture(scope="module")
def converted(raw, tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in cache:
            out = tmp_path_factory.mktemp(layout) / "mlx"
            cache[layout] = convert(str(raw(layout)), output=out).output
        return cache[layout]

    return get


def stock_convert(src: Path, out: Path, **kwargs) -> Path:
    from mlx_lm.convert import convert as stock

    with contextlib.redirect_stdout(io.StringIO()):
        stock(str(src), str(out), **kwargs)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_finds_the_nextn_head(raw, layout: str) -> None:
    root = raw(layout)
    config = json.loads((root / "config.json").read_text())
    where, experts, declared = HEADS[layout]
    if where == "nextn":
        where = f"model.layers.{config['num_hidden_layers']}."
    names = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    result = inspect_checkpoint(str(root))
    mtp = result["mtp"]
    assert result["problems"] == []
    assert mtp["present"] is True
    assert {t["name"] for t in mtp["tensors"]} == {n for n in names if n.startswith(where)}
    assert (mtp["expert_layout"], mtp["declared_layers"], mtp["norm_convention"]) == (
        experts,
        declared,
        "plain",
    )
    assert type(family_for(config)).name == layout


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backbone_equals_stock_mlx_lm_convert(raw, layout: str, bits, tmp_path: Path) -> None:
    from mlx_lm import load

    src = raw(layout)
    out = convert(str(src), output=tmp_path / "out", bits=bits).output
    # Stock sanitize drops every layer from num_hidden_layers on: it converts the full source.
    stock_kwargs = {"quantize": True, "q_bits": bits, "q_group_size": 64} if bits else {}
    ref = stock_convert(src, tmp_path / "ref", **stock_kwargs)
    (mine, _), (theirs, _) = load(str(out)), load(str(ref))
    a, b = dict(tree_flatten(mine.parameters())), dict(tree_flatten(theirs.parameters()))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and mx.array_equal(a[name], b[name]).item(), name
    tokens = mx.array([PROMPT])
    assert mx.array_equal(mine(tokens), theirs(tokens)).item()
    head = mx.load(str(out / "mtp" / "weights.safetensors"))
    assert any(k.endswith("eh_proj.weight") for k in head)
    if bits:
        assert any(k.endswith("eh_proj.scales") for k in head)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_logits_match_the_numpy_reference(raw, converted, layout: str) -> None:
    m = load_model(converted(layout))
    tokens = mx.array(PROMPT)
    m.forward(tokens[None, :-1], m.make_cache())
    hidden = m.hidden_state()  # h_k after each prompt token but the last (post-norm)
    x = m.head(hidden, m.embed(tokens[None, 1:]), m.head.make_cache())
    logits = m.lm_head(m.head.final_norm(0)(x))[0]
    config = json.loads((raw(layout) / "config.json").read_text())
    reference = REFERENCE[HEADS[layout][0]]
    expected = reference(load_raw(raw(layout)), config, np.array(hidden[0]), np.array(PROMPT[1:]))
    assert logits.shape == expected.shape
    np.testing.assert_allclose(np.array(logits), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_mtp_equals_plain_decoding(converted, layout: str) -> None:
    m = load_model(converted(layout))
    plain = generate(m, PROMPT, max_tokens=16, mtp=False)
    drafted = generate(m, PROMPT, max_tokens=16, depth=3, adaptive=False)
    assert drafted.tokens == plain.tokens and drafted.drafted > 0


@pytest.mark.parametrize("layout", ["glm4_moe_lite", "deepseek_v32", "longcat_flash"])
def test_partial_acceptance_keeps_the_caches_exact(converted, layout: str) -> None:
    """Drafts right up to depth j, then wrong: the backbone's caches (DSA's cache pairs
    included) are trimmed back each round and the output stays plain decoding's."""
    m = load_model(converted(layout))
    n = 24
    reference = generate(m, PROMPT, max_tokens=n, mtp=False).tokens
    decoder = MtpDecoder(m, PROMPT, depth=3, sampling=SamplingSettings(), adaptive=False)
    vocab = m.embedding.weight.shape[0]
    plan = [0, 3, 1, 2] * 10
    rights = inject_drafts(decoder, reference, plan, vocab)
    assert list(decoder.tokens(n)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights) and set(accepted) == {0, 1, 2, 3}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_passes_the_healthy_head_and_fails_a_damaged_one(
    converted, layout: str, tmp_path: Path
) -> None:
    healthy = check_checkpoint(str(converted(layout)), probe=False)
    assert healthy["verdict"] == "pass", healthy["checks"]
    damaged = Path(shutil.copytree(converted(layout), tmp_path / "damaged"))
    head_file = damaged / "mtp" / "weights.safetensors"
    head = mx.load(str(head_file))
    del head["mtp.layers.0.eh_proj.weight"]
    mx.save_safetensors(str(head_file), head, metadata={"format": "mlx"})
    result = check_checkpoint(str(damaged), probe=False)
    assert result["verdict"] == "fail"
    failed = {c["name"] for c in result["checks"] if c["status"] == "fail"}
    assert "head_complete" in failed, result["checks"]
