"""The Bailing families: Ling-3 (`bailing_moe_v3`, KDA + MLA) and Ling-2.5/2.6
(`bailing_hybrid`, lightning attention + MLA), MTP layers appended after the base ones.

Each family's tiny checkpoint (tests/fixtures/<model_type>.py, the published layout) goes
through every stage: inspect finds the head; convert's backbone equals stock
`mlx_lm.convert`'s (loaded by stock `mlx_lm.load`, parameters and logits bit for bit); the
converted head's logits equal a float32 numpy forward of vLLM's Bailing MTP step
(tests/bailing_reference.py); greedy `generate --mtp` equals plain decoding, also when
injected drafts are accepted part of the way, which rolls the linear-attention states back by
replay (`mtpkit.runtime.rollback.replay`); `check` passes the healthy head and fails a damaged one.
"""

from __future__ import annotations

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
from mtpkit.runtime.rollback.replay import CacheReplay
from mtpkit.speculative.generate import MtpDecoder, SamplingSettings, generate, load_model
from tests.bailing_reference import bailing_mtp_logits
from tests.checkpoints import CheckpointFactory
from tests.injected import accepted_per_round, inject_drafts, planned_per_round
from tests.mtp_reference import load_raw
from tests.test_mla_families import stock_convert

LAYOUTS = ("bailing_moe_v3", "bailing_hybrid")
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_finds_the_appended_mtp_layer(raw, layout: str) -> None:
    root = raw(layout)
    config = json.loads((root / "config.json").read_text())
    where = f"model.layers.{config['num_hidden_layers']}."
    names = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    result = inspect_checkpoint(str(root))
    mtp = result["mtp"]
    assert result["problems"] == []
    assert mtp["present"] is True
    assert {t["name"] for t in mtp["tensors"]} == {n for n in names if n.startswith(where)}
    assert (mtp["expert_layout"], mtp["declared_layers"], mtp["norm_convention"]) == (
        "per_expert",
        1,
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
    assert "mtp.layers.0.final_layernorm.weight" in head
    if bits:
        assert "mtp.layers.0.eh_proj.scales" in head


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_logits_match_the_numpy_reference(raw, converted, layout: str) -> None:
    m = load_model(converted(layout))
    tokens = mx.array(PROMPT)
    m.forward(tokens[None, :-1], m.make_cache())
    hidden = m.hidden_state()  # h_k after each prompt token but the last (post-norm)
    x = m.head(hidden, m.embed(tokens[None, 1:]), m.head.make_cache())
    logits = m.lm_head(m.head.final_norm(0)(x))[0]
    config = json.loads((raw(layout) / "config.json").read_text())
    w = load_raw(raw(layout))
    expected = bailing_mtp_logits(w, config, np.array(hidden[0]), np.array(PROMPT[1:]))
    assert logits.shape == expected.shape
    np.testing.assert_allclose(np.array(logits), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_mtp_equals_plain_decoding(converted, layout: str) -> None:
    m = load_model(converted(layout))
    plain = generate(m, PROMPT, max_tokens=16, mtp=False)
    drafted = generate(m, PROMPT, max_tokens=16, depth=3, adaptive=False)
    assert drafted.tokens == plain.tokens and drafted.drafted > 0


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_partial_acceptance_replays_the_linear_attention_states(
    converted, layout: str, pipeline: bool
) -> None:
    """Drafts right up to depth j, then wrong: every round ends with the caches as plain
    decoding leaves them (restored and replayed), so the output stays plain decoding's."""
    m = load_model(converted(layout))
    n = 24
    reference = generate(m, PROMPT, max_tokens=n, mtp=False).tokens
    decoder = MtpDecoder(
        m, PROMPT, depth=3, sampling=SamplingSettings(), adaptive=False, pipeline=pipeline
    )
    vocab = m.embedding.weight.shape[0]
    plan = [0, 3, 1, 3, 2, 3] * 10
    rights = inject_drafts(decoder, reference, plan, vocab)
    verify = m.verify
    replays: list[bool] = []

    def verify_and_record(tokens, cache):
        verified = verify(tokens, cache)
        replays.append(isinstance(verified.replay, CacheReplay))
        return verified

    m.verify = verify_and_record
    assert list(decoder.tokens(n)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights) and set(accepted) == {0, 1, 2, 3}
    assert replays and all(replays)
    if pipeline:  # queued rounds were both used (after a full round) and discarded
        assert decoder.stats.discarded > 0 and decoder.stats.pipelined > decoder.stats.discarded


def test_replay_restores_exactly_the_plain_caches(converted) -> None:
    """After a verify pass of 4 tokens rolled back to 2, every cache holds what a plain
    pass over those 2 tokens leaves (KV offsets and keys, KDA conv and recurrent states)."""
    m = load_model(converted("bailing_moe_v3"))
    prompt, verify_tokens = mx.array([PROMPT[:8]]), mx.array(PROMPT[8:12])
    rolled, plain = m.make_cache(), m.make_cache()
    for caches in (rolled, plain):
        m.forward(prompt, caches)
    m.verify(verify_tokens, rolled).rollback(rolled, 2)
    m.forward(verify_tokens[None, :2], plain)
    for a, b in zip(rolled, plain, strict=True):
        assert type(a) is type(b)
        if a.is_trimmable():  # KV: the entries up to the offset (the buffer beyond is stale)
            assert a.offset == b.offset
            xs = [t[..., : a.offset, :] for t in (a.keys, a.values)]
            ys = [t[..., : b.offset, :] for t in (b.keys, b.values)]
        else:  # KDA: three conv states and the recurrent state
            xs, ys = a.cache, b.cache
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-6)


def test_gated_delta_net_models_keep_the_snapshot_rollback(checkpoint: CheckpointFactory) -> None:
    """Qwen3.5's gated-delta-net caches are covered by the per-token snapshots: no replay."""
    m = load_model(checkpoint("qwen3_5"))
    cache = m.make_cache()
    m.forward(mx.array([PROMPT[:8]]), cache)
    verified = m.verify(mx.array(PROMPT[8:11]), cache)
    assert verified.replay is None and verified.snapshots is not None


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
