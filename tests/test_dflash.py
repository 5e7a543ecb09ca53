"""DFlash block drafters (`--draft-model DFLASH_DIR`) on tiny drafters in z-lab's published
format, for a Llama and a Qwen3 dense target.

Each proof is against something independent: stock mlx-lm's plain greedy tokens, a float32
numpy drafter and speculative loop written from z-lab's transformers code over stock
mlx-lm's layer outputs (`tests/dflash_reference.py`: every round's drafts, every round's
acceptance), drafts injected right-then-wrong (every partial acceptance, the drafter's
drafts after each still the reference's), and the exact distribution of the first two
sampled tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.dflash import load_dflash
from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.decode import MtpDecoder
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from tests.checkpoints import build_dense_model
from tests.dflash_checkpoints import build_dflash, fit_dflash
from tests.dflash_reference import ReferenceDFlash, StockTarget, reference_loop
from tests.injected import accepted_per_round, inject_drafts, planned_per_round
from tests.stock import stock_tokens
from tests.test_generate_sampling import CHI2_999, chi_square, exact_pairs
from tests.test_proposers import _first_two

PROMPT = list(range(5, 21))
LAYERS = [0, 2]  # of a 4-layer target: neither the last (its output is normed in HF's list)


def pair(tmp: Path, family: str, **kwargs) -> tuple[Path, Path]:
    target = build_dense_model(tmp / f"{family}-target", family, layers=4)
    return target, build_dflash(tmp / f"{family}-dflash", target, target_layer_ids=LAYERS, **kwargs)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, target, drafter): a drafter fitted to the target's greedy text after
    PROMPT (a few seconds), so that the target keeps some of its drafts."""
    family = request.param
    target, draft = pair(tmp_path_factory.mktemp(family), family)
    text = stock_tokens(target, PROMPT, 28, eos=False)
    fit_dflash(draft, target, PROMPT + text, len(PROMPT) - 1, steps=25)
    return family, target, draft


def decoder_for(target: Path, draft: Path, depth: int, prompt: list[int] = PROMPT,
                **kwargs) -> MtpDecoder:  # fmt: skip
    m = load_model(target, with_head=False)
    proposer = ProposerFactory(m, DrafterChoice(draft_model=draft))()
    m.tokenizer.eos_token_ids = []
    return MtpDecoder(m, prompt, depth=depth, adaptive=False, proposer=proposer,
                      sampling=kwargs.pop("sampling", SamplingSettings()), **kwargs)  # fmt: skip


def spy_drafts(decoder: MtpDecoder) -> list[tuple[int, list[int]]]:
    """The proposer's own drafts of each round, by position, before any injection."""
    seen: list[tuple[int, list[int]]] = []
    inner = decoder.draft_filter

    def spy(position: int, drafts: mx.array) -> mx.array:
        seen.append((position, drafts.tolist()))
        return drafts if inner is None else inner(position, drafts)

    decoder.draft_filter = spy
    return seen


def test_the_tap_leaves_the_targets_logits_unchanged(tmp_path: Path) -> None:
    """Logits of a pass bit-identical with and without the layer tap; the tapped features
    are stock mlx-lm's layer outputs."""
    target = build_dense_model(tmp_path / "t", "qwen3", layers=4)
    m = load_model(target, with_head=False)
    tokens = mx.array(PROMPT)[None]
    before, _ = m.forward(tokens, m.make_cache())
    m.tap_layers(tuple(LAYERS))
    after, features = m.forward(tokens, m.make_cache())
    assert mx.array_equal(before, after)
    stock, _ = StockTarget(target).layer_outputs(PROMPT, LAYERS)
    np.testing.assert_allclose(np.array(features[0]), stock, atol=1e-5)


def test_the_drafter_is_the_reference_through_its_cache(tmp_path: Path) -> None:
    """The drafter's logits after a context fed in two passes (the first cached) are the
    numpy reference's over the whole context in one."""
    target, draft = pair(tmp_path, "llama")
    stock, ref = StockTarget(target), ReferenceDFlash(draft)
    features, _ = stock.layer_outputs(PROMPT, LAYERS)
    d = load_dflash(draft)
    cache = d.model.make_cache()
    m = load_model(target, with_head=False)
    block = m.embed(mx.array([[PROMPT[-1]] + [d.layout.mask_token_id] * 5]))
    d.model(block, mx.array(features[None, :9]), cache)  # a first round: context 0..8
    h = d.model(block, mx.array(features[None, 9:]), cache)
    assert cache[0].offset == len(PROMPT)
    logits = np.array(m.lm_head(h[:, 1:])[0])
    np.testing.assert_allclose(logits, ref.logits(features, PROMPT[-1], 5, stock), atol=2e-3)


def test_greedy_is_stock_and_every_round_is_the_references(trained) -> None:
    """Token-identical to stock mlx-lm's greedy; each round's drafts are the numpy
    drafter's over the same confirmed tokens, and each round keeps what the reference loop
    keeps (a fitted drafter: some rounds keep drafts, some none)."""
    _, target, draft = trained
    n, depth = 24, 4
    reference = stock_tokens(target, PROMPT, n, eos=False)
    decoder = decoder_for(target, draft, depth)
    seen = spy_drafts(decoder)
    assert list(decoder.tokens(n)) == reference
    assert decoder.stats.proposer == "dflash"
    stock, ref = StockTarget(target), ReferenceDFlash(draft)
    text = PROMPT + reference
    for position, drafts in seen:
        assert drafts == ref.drafts(text[:position], len(drafts), stock), position
    tokens, accepted = reference_loop(ref, stock, PROMPT, depth, n)
    assert tokens == reference
    ours = accepted_per_round(decoder)
    assert ours == accepted[: len(ours)]
    assert decoder.stats.accepted == sum(accepted[: decoder.stats.rounds])
    assert decoder.stats.accepted >= 6 and 0 in accepted


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_partial_acceptances_keep_the_drafter_on_the_reference(
    tmp_path: Path, family: str
) -> None:
    """Drafts injected right up to a planned depth: exactly those are kept, the text is
    stock's, and after every partial acceptance the drafter's own drafts are still the
    reference's over the confirmed tokens (its context of kept positions is right)."""
    target, draft = pair(tmp_path, family)
    n, depth = 30, 3
    reference = stock_tokens(target, PROMPT, n, eos=False)
    decoder = decoder_for(target, draft, depth)
    rights = inject_drafts(decoder, reference, [0, 3, 1, 2, 3, 0, 2, 1] * 10, 512)
    seen = spy_drafts(decoder)
    assert list(decoder.tokens(n)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights)
    assert set(accepted) == {0, 1, 2, 3}
    stock, ref = StockTarget(target), ReferenceDFlash(draft)
    text = PROMPT + reference
    for position, drafts in seen:
        assert drafts == ref.drafts(text[:position], len(drafts), stock), position


def test_a_block_is_at_most_the_drafters_block_size(tmp_path: Path) -> None:
    """--num-draft-tokens past block_size - 1 drafts a full block, no more."""
    target, draft = pair(tmp_path, "llama", block_size=4)
    decoder = decoder_for(target, draft, depth=8)
    seen = spy_drafts(decoder)
    assert list(decoder.tokens(10)) == stock_tokens(target, PROMPT, 10, eos=False)
    assert {len(d) for _, d in seen} == {3}


def test_sampling_keeps_the_target_distribution(trained) -> None:
    """The first two tokens sampled with DFlash drafting follow the target's exact joint
    distribution under top-k 3 (rejection sampling against each block position's own
    distribution; a fitted drafter, whose drafts are often kept)."""
    _, target, draft = trained
    m = load_model(target, with_head=False)
    settings = SamplingSettings(temp=1.0, top_k=3)
    exact = exact_pairs(m, PROMPT, settings)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))

    def decoder() -> MtpDecoder:
        return MtpDecoder(m, PROMPT, depth=2, sampling=settings, adaptive=False, proposer=factory())

    n = 400
    counts = _first_two(decoder, PROMPT, settings, n)
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    stat, dof = chi_square(Counter({index.get(k, -1): v for k, v in counts.items()}),
                           {index[k]: v for k, v in exact.items()}, n)  # fmt: skip
    assert stat < CHI2_999[dof]


def test_a_drafter_for_another_target_is_one_line(tmp_path: Path) -> None:
    target = build_dense_model(tmp_path / "target", "llama", layers=4)
    other = build_dense_model(tmp_path / "other", "llama", layers=6)
    draft = build_dflash(tmp_path / "d", other, target_layer_ids=LAYERS)
    m = load_model(target, with_head=False)
    with pytest.raises(MtpkitError, match=r"for another target than target: it reads a "
                                          r"target of 6 layers, and this one has 4"):  # fmt: skip
        ProposerFactory(m, DrafterChoice(draft_model=draft))


def test_a_drafter_missing_a_tensor_is_one_line(tmp_path: Path) -> None:
    target = build_dense_model(tmp_path / "target", "llama", layers=4)
    draft = build_dflash(tmp_path / "d", target, target_layer_ids=LAYERS)
    tensors = mx.load(str(draft / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    mx.save_safetensors(str(draft / "model.safetensors"), tensors, metadata={"format": "pt"})
    with pytest.raises(MtpkitError, match="it lacks layers.1.mlp.up_proj.weight") as e:
        load_dflash(draft)
    assert "\n" not in str(e.value)


def test_a_next_turn_drafts_from_the_prompt_caches_state(tmp_path: Path) -> None:
    """A session's second turn extends the first from the prompt cache (the drafter's
    state forked with the target's cache): the text is stock's for the whole prompt and its
    drafts are the reference's over the confirmed tokens."""
    from mtpkit.speculative.session import Engine, Request

    target, draft = pair(tmp_path, "qwen3")
    m = load_model(target, with_head=False)
    m.tokenizer.eos_token_ids = []
    engine = Engine(m, drafter=DrafterChoice(draft_model=draft), prompt_cache_size=4)
    first = engine.session(Request(PROMPT, max_tokens=12, depth=3, adaptive=False))
    said = [e.token for e in first if e.token is not None]
    turn = PROMPT + said + [30, 31, 32]
    second = engine.session(Request(turn, max_tokens=12, depth=3, adaptive=False))
    seen = spy_drafts(second.decoder)
    answer = [e.token for e in second if e.token is not None]
    assert second.stats.cached_tokens == len(PROMPT) + len(said) - 1
    reference = stock_tokens(target, turn, 12, eos=False)
    assert answer == reference
    stock, ref = StockTarget(target), ReferenceDFlash(draft)
    assert seen
    for position, drafts in seen:
        assert drafts == ref.drafts((turn + reference)[:position], len(drafts), stock), position


def test_a_long_prompt_is_put_in_the_drafters_cache_as_it_is_prefilled(tmp_path: Path) -> None:
    """A prompt longer than a context chunk (its K/V computed at once, its features not
    kept), prefilled in chunks: the text is stock's and the drafts the reference's."""
    from mtpkit.speculative.proposers.dflash import CONTEXT_CHUNK

    target, draft = pair(tmp_path, "llama")
    prompt = [(7 * i) % 500 + 3 for i in range(CONTEXT_CHUNK + 40)]
    decoder = decoder_for(target, draft, 3, prompt)
    decoder.prefill_step_size = CONTEXT_CHUNK + 8
    seen = spy_drafts(decoder)
    stream = decoder.proposer.stream
    after_prefill = []
    decoder.after_prefill = lambda: after_prefill.append((stream.cached, stream.covered))
    reference = stock_tokens(target, prompt, 8, eos=False)
    assert list(decoder.tokens(8)) == reference
    # In the cache as prefilled: only the last chunk's few positions still pending.
    assert after_prefill == [(CONTEXT_CHUNK + 8, len(prompt) - 1)]
    stock, ref = StockTarget(target), ReferenceDFlash(draft)
    for position, drafts in seen:
        assert drafts == ref.drafts((prompt + reference)[:position], len(drafts), stock), position
