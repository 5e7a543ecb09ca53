"""Gemma 4's assistant in MLX against transformers' `Gemma4AssistantForCausalLM`.

The reference (`tests/references/gemma4_assistant.npz`) was computed by
`scripts/gemma4_reference.py` from the very checkpoints `tests/gemma4_checkpoints.py` builds
here (same seeds, float32): prefill on transformers' Gemma 4 target, then three greedy draft
steps as transformers' `SinglePositionMultiTokenCandidateGenerator` takes them. Stock mlx-lm
runs the target here; mtpkit's assistant reads its caches.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit.runtime.assistant import TargetReader, load_assistant
from tests.gemma4_checkpoints import build_assistant, build_target

REFERENCE = Path(__file__).parent / "references" / "gemma4_assistant.npz"
HEADS = {"dense": False, "masked": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    from mlx_lm import load

    root = tmp_path_factory.mktemp("gemma4")
    target_dir = build_target(root / "target")
    model, _ = load(str(target_dir))
    text = json.loads((target_dir / "config.json").read_text())["text_config"]
    assistants = {
        head: load_assistant(build_assistant(root / head, ordered=ordered))
        for head, ordered in HEADS.items()
    }
    return model, text, assistants


def _prefill(model, text, prompt: list[int]):
    """Stock mlx-lm's target over the prompt: its caches, final-normed hidden states, and
    last-position logits."""
    lm = model.language_model
    cache = model.make_cache()
    hidden = lm.model(mx.array([prompt]), cache=cache)
    logits = lm.model.embed_tokens.as_linear(hidden[:, -1])
    cap = text["final_logit_softcapping"]
    return cache, hidden, mx.tanh(logits / cap) * cap


def _draft(model, text, assistant, prompt, bonus, steps=3):
    cache, hidden, _ = _prefill(model, text, prompt)
    reader = TargetReader.of(text, model.language_model.model.embed_tokens)
    kv = reader.kv(cache)
    token, h = bonus, hidden[:, -1:]
    out = []
    for _ in range(steps):
        logits, h = assistant(reader.embed(mx.array([[token]])), h, kv, len(prompt))
        out.append(np.array(logits[0, 0]))
        token = int(mx.argmax(logits[0, 0]))
    return np.stack(out)


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_draft_logits_match_transformers(pair, head, prompt):
    model, text, assistants = pair
    ref = np.load(REFERENCE)
    tokens = ref[f"{prompt}/prompt"].tolist()
    _, _, target_logits = _prefill(model, text, tokens)
    # The target itself agrees (stock mlx-lm vs transformers): the inputs are the same.
    np.testing.assert_allclose(
        np.array(target_logits[0]), ref[f"{prompt}/{head}/target_logits"], atol=1e-4
    )
    bonus = int(ref[f"{prompt}/{head}/bonus"])
    drafted = _draft(model, text, assistants[head], tokens, bonus)
    expected = ref[f"{prompt}/{head}/draft_logits"]
    np.testing.assert_allclose(drafted, expected, rtol=1e-4, atol=1e-3)
    assert drafted.argmax(-1).tolist() == ref[f"{prompt}/{head}/draft_tokens"].tolist()


def test_long_prompt_crosses_the_sliding_window(pair):
    """Past the window the sliding layers must see only the newest window + 1 entries: the
    same step without that mask gives other logits than the reference."""
    model, text, assistants = pair
    ref = np.load(REFERENCE)
    tokens = ref["long/prompt"].tolist()
    assert len(tokens) > text["sliding_window"] + 1
    assistant = assistants["dense"]
    kept = assistant.sliding_window
    assistant.sliding_window = 10**6  # no mask: every entry visible
    try:
        unmasked = _draft(model, text, assistant, tokens, int(ref["long/dense/bonus"]), steps=1)
    finally:
        assistant.sliding_window = kept
    assert np.abs(unmasked[0] - ref["long/dense/draft_logits"][0]).max() > 1e-2


def test_greedy_of_the_masked_head_is_the_argmax_of_its_logits(pair):
    model, text, assistants = pair
    assistant = assistants["masked"]
    h = mx.random.normal((1, 3, assistant.args.hidden_size), key=mx.random.key(0))
    assert assistant.greedy(h).tolist() == mx.argmax(assistant.logits(h), axis=-1).tolist()


def test_masked_head_scores_only_the_top_clusters(pair):
    _, _, assistants = pair
    assistant = assistants["masked"]
    h = mx.random.normal((1, 1, assistant.args.hidden_size), key=mx.random.key(1))
    logits = np.array(assistant.logits(h))[0, 0]
    floor = logits.min()
    head = assistant.masked_embedding
    kept = (logits > floor).sum()
    assert kept == head.top_k * (head.vocab // head.centroids.weight.shape[0])
