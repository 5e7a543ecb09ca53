"""EAGLE-3 drafters (`--draft-model EAGLE3_DIR`) on tiny drafters in their published formats
(`tests/eagle3_checkpoints.py`), for a Llama and a Qwen3 dense target.

Each proof is against something independent: stock mlx-lm's plain greedy tokens, a float32
numpy drafter and speculative loop written from the EAGLE repo's `cnets.py` over stock
mlx-lm's layer inputs (`tests/eagle3_reference.py`: every round's drafts, every round's
acceptance, each draft's distribution), drafts injected right-then-wrong (every partial
acceptance, the drafter's drafts after each still the reference's), and the exact
distribution of the first two sampled tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.eagle3 import load_eagle3
from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.decode import MtpDecoder
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from tests.checkpoints import build_dense_model
from tests.eagle3_checkpoints import build_eagle3, fit_eagle3
from tests.eagle3_reference import ReferenceEagle3, StockInputs, reference_loop
from tests.injected import accepted_per_round, inject_drafts, planned_per_round
from tests.stock import stock_tokens
from tests.test_dflash import spy_drafts
from tests.test_generate_sampling import CHI2_999, chi_square, exact_pairs
from tests.test_proposers import _first_two

PROMPT = list(range(5, 21))
# family -> (target layers, the drafter's format, the layer ids its config names)
SHAPES = {"llama": (8, "eagle", None), "qwen3": (6, "speculators", [1, 3, 5])}


def pair(tmp: Path, family: str, text: int = 24, **kwargs) -> tuple[Path, Path]:
    """A target and a drafter whose draft vocabulary holds the prompt, the target's greedy
    text and some other tokens (as EAGLE's d2t keeps the frequent ones)."""
    layers, style, ids = SHAPES[family]
    target = build_dense_model(tmp / f"{family}-target", family, layers=layers)
    vocab = set(PROMPT + stock_tokens(target, PROMPT, text, eos=False)) | set(range(100, 160))
    kwargs.setdefault("layer_ids", ids)
    draft = build_eagle3(tmp / f"{family}-eagle3", target, vocab_ids=sorted(vocab), style=style,
                         **kwargs)  # fmt: skip
    return target, draft


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family, target, drafter): a drafter fitted to the target's greedy text after
    PROMPT (a few seconds), so that the target keeps some of its drafts."""
    family = request.param
    target, draft = pair(tmp_path_factory.mktemp(family), family, text=28)
    text = stock_tokens(target, PROMPT, 28, eos=False)
    fit_eagle3(draft, target, PROMPT + text, len(PROMPT) - 1, steps=20)
    return family, target, draft


def decoder_for(target: Path, draft: Path, depth: int, prompt: list[int] = PROMPT,
                **kwargs) -> MtpDecoder:  # fmt: skip
    m = load_model(target, with_head=False)
    proposer = ProposerFactory(m, DrafterChoice(draft_model=draft))()
    m.tokenizer.eos_token_ids = []
    return MtpDecoder(m, prompt, depth=depth, adaptive=False, proposer=proposer,
                      sampling=kwargs.pop("sampling", SamplingSettings()), **kwargs)  # fmt: skip


def test_the_tap_reads_layer_inputs_and_leaves_the_logits_unchanged(tmp_path: Path) -> None:
    """Logits of a pass bit-identical with and without the tap; the features are stock
    mlx-lm's inputs of layers 2, N // 2, N - 3 (EAGLE's default)."""
    target, draft = pair(tmp_path, "llama", text=4)
    m = load_model(target, with_head=False)
    tokens = mx.array(PROMPT)[None]
    before, _ = m.forward(tokens, m.make_cache())
    ProposerFactory(m, DrafterChoice(draft_model=draft))()  # taps the target
    after, features = m.forward(tokens, m.make_cache())
    assert mx.array_equal(before, after)
    stock, _ = StockInputs(target).layer_inputs(PROMPT, [2, 4, 5])
    np.testing.assert_allclose(np.array(features[0]), stock, atol=1e-5)


# Llama 3.1's RoPE scaling, its context scaled down so that the 16-wide heads' frequencies
# fall in all three of its bands (scaled, smoothed, kept).
LLAMA3_ROPE = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64}}  # fmt: skip


@pytest.mark.parametrize(("family", "fields"), [("qwen3", None), ("llama", LLAMA3_ROPE)])
def test_the_drafter_is_the_reference_through_its_cache(
    tmp_path: Path, family: str, fields: dict | None
) -> None:
    """The drafter's logits of a chain after pairs fed in two passes (the first cached) are
    the numpy reference's over all its inputs in one (plain RoPE, and Llama 3.1's scaled)."""
    target, draft = pair(tmp_path, family, text=4, fields=fields)
    stock = StockInputs(target)
    ref = ReferenceEagle3(draft, stock)
    features, _ = stock.layer_inputs(PROMPT[:-1], ref.ids)
    d = load_eagle3(draft)
    model, cache = d.model, d.model.make_cache()
    embed = load_model(target, with_head=False).embed
    pairs = mx.array(PROMPT[1:])[None]
    model(embed(pairs[:, :6]), model.fuse(mx.array(features[None, :6])), cache)
    x = model(embed(pairs[:, 6:]), model.fuse(mx.array(features[None, 6:])), cache)[:, -1:]
    forced = [40, 41, 42]
    logits = [model.draft_logits(x)]
    for token in forced[:-1]:
        x = model(embed(mx.array([[token]])), x, cache)
        logits.append(model.draft_logits(x))
    ours = np.array(mx.concatenate(logits, axis=1)[0].astype(mx.float32))
    np.testing.assert_allclose(ours, ref.logits(PROMPT, 3, forced=forced), atol=2e-3)
    assert cache[0].offset == len(PROMPT) - 1 + 2


def test_greedy_is_stock_and_every_round_is_the_references(trained) -> None:
    """Token-identical to stock mlx-lm's greedy; each round's drafts are the numpy
    drafter's over the same confirmed tokens, and each round keeps what the reference loop
    keeps (a fitted drafter: some rounds keep drafts, some none)."""
    _, target, draft = trained
    n, depth = 24, 3
    reference = stock_tokens(target, PROMPT, n, eos=False)
    decoder = decoder_for(target, draft, depth)
    seen = spy_drafts(decoder)
    assert list(decoder.tokens(n)) == reference
    assert decoder.stats.proposer == "eagle3"
    ref = ReferenceEagle3(draft, StockInputs(target))
    text = PROMPT + reference
    for position, drafts in seen:
        assert drafts == ref.drafts(text[:position], len(drafts)), position
    tokens, accepted = reference_loop(ref, PROMPT, depth, n)
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
    reference's over the confirmed tokens (its cache holds the confirmed pairs only)."""
    target, draft = pair(tmp_path, family, text=30)
    n, depth = 30, 3
    reference = stock_tokens(target, PROMPT, n, eos=False)
    decoder = decoder_for(target, draft, depth)
    rights = inject_drafts(decoder, reference, [0, 3, 1, 2, 3, 0, 2, 1] * 10, 512)
    seen = spy_drafts(decoder)
    assert list(decoder.tokens(n)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights)
    assert set(accepted) == {0, 1, 2, 3}
    ref = ReferenceEagle3(draft, StockInputs(target))
    text = PROMPT + reference
    for position, drafts in seen:
        assert drafts == ref.drafts(text[:position], len(drafts)), position


def test_sampled_drafts_come_with_the_drafters_distribution(tmp_path: Path) -> None:
    """At temperature 1 each draft's distribution is the reference drafter's softmax over
    its draft vocabulary, mapped through d2t, zero on every other token."""
    target, draft = pair(tmp_path, "llama", text=4)
    decoder = decoder_for(target, draft, 3, sampling=SamplingSettings(temp=1.0))
    decoder.prefill()
    proposal = decoder.proposer.propose(3, decoder.sampling)
    drafts, dists = proposal.drafts.tolist(), np.array(proposal.dists)
    expected = ReferenceEagle3(draft, StockInputs(target)).dists(PROMPT, drafts)
    np.testing.assert_allclose(dists, expected, atol=2e-4)
    outside = np.ones(512, bool)
    outside[np.array(load_eagle3(draft).target_ids)] = False
    assert not dists[:, outside].any() and outside.sum() > 300


def test_sampling_keeps_the_target_distribution(trained) -> None:
    """The first two tokens sampled with EAGLE-3 drafting follow the target's exact joint
    distribution under top-k 3 (rejection sampling against the drafter's distribution over
    its draft vocabulary; a fitted drafter, whose drafts are often kept)."""
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
    other = build_dense_model(tmp_path / "other", "llama", layers=8)
    draft = build_eagle3(tmp_path / "d", other, vocab_ids=list(range(64)), layer_ids=[2, 4, 7])
    m = load_model(target, with_head=False)
    with pytest.raises(MtpkitError, match=r"for another target than target: it reads target "
                                          r"layers \[7\], and this one has 4"):  # fmt: skip
        ProposerFactory(m, DrafterChoice(draft_model=draft))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("del midlayer.mlp.up_proj.weight", "it lacks midlayer.mlp.up_proj.weight"),
        ("del d2t", "it lacks d2t"),
        ("d2t", "d2t maps draft ids outside the target vocabulary of 512 or two onto one"),
    ],
)
def test_a_broken_drafter_is_one_line(tmp_path: Path, edit: str, message: str) -> None:
    target = build_dense_model(tmp_path / "target", "llama", layers=4)
    draft = build_eagle3(tmp_path / "d", target, vocab_ids=list(range(64)))
    tensors = mx.load(str(draft / "model.safetensors"))
    if edit.startswith("del "):
        del tensors[edit.removeprefix("del ")]
    else:  # draft ids 0 and 1 both onto token 1
        tensors["d2t"] = mx.concatenate([mx.array([1], mx.int64), tensors["d2t"][1:]])
    mx.save_safetensors(str(draft / "model.safetensors"), tensors, metadata={"format": "pt"})
    with pytest.raises(MtpkitError, match=message) as e:
        load_eagle3(draft)
    assert "\n" not in str(e.value)


def test_a_next_turn_drafts_from_the_prompt_caches_state(tmp_path: Path) -> None:
    """A session's second turn extends the first from the prompt cache (the drafter's
    cache and pending pairs forked with the target's cache): the text is stock's for the
    whole prompt and its drafts are the reference's over the confirmed tokens."""
    from mtpkit.speculative.session import Engine, Request

    target, draft = pair(tmp_path, "qwen3", text=4)
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
    ref = ReferenceEagle3(draft, StockInputs(target))
    assert seen
    for position, drafts in seen:
        assert drafts == ref.drafts((turn + reference)[:position], len(drafts)), position


def test_a_long_prompt_goes_into_the_drafters_cache_as_it_is_prefilled(tmp_path: Path) -> None:
    """A prompt past a catch-up chunk, prefilled in chunks: its pairs are in the drafter's
    cache after the prefill (one left to draft from), the text is stock's and the drafts the
    reference's."""
    from mtpkit.speculative.proposers.eagle3 import CATCH_UP_CHUNK

    target, draft = pair(tmp_path, "llama", text=4)
    prompt = [(7 * i) % 500 + 3 for i in range(CATCH_UP_CHUNK + 40)]
    decoder = decoder_for(target, draft, 3, prompt)
    decoder.prefill_step_size = CATCH_UP_CHUNK + 8
    seen = spy_drafts(decoder)
    proposer = decoder.proposer
    after_prefill = []
    decoder.after_prefill = lambda: after_prefill.append(
        (int(proposer.cache[0].offset), len(proposer.tokens)))  # fmt: skip
    reference = stock_tokens(target, prompt, 8, eos=False)
    assert list(decoder.tokens(8)) == reference
    assert after_prefill == [(CATCH_UP_CHUNK + 8 - 1, len(prompt) - CATCH_UP_CHUNK - 8)]
    ref = ReferenceEagle3(draft, StockInputs(target))
    for position, drafts in seen:
        assert drafts == ref.drafts((prompt + reference)[:position], len(drafts)), position


def test_a_batch_session_takes_the_drafter(tmp_path: Path) -> None:
    """A batch session drafts with it (`Eagle3Rows`; tests/test_batch_eagle3.py proves the
    rows): two requests' tokens are stock mlx-lm's, and drafts were verified."""
    from mtpkit.speculative.batch import BatchSession
    from mtpkit.speculative.session import Engine, Request

    target, draft = pair(tmp_path, "llama", text=4)
    m = load_model(target, with_head=False)
    m.tokenizer.eos_token_ids = []
    session = BatchSession(Engine(m, drafter=DrafterChoice(draft_model=draft)), adaptive=False)
    prompts = [PROMPT, [300, 301, 302]]
    entries = [session.add(Request(p, max_tokens=8, depth=2)) for p in prompts]
    while session.entries:
        session.step()
    for entry, prompt in zip(entries, prompts, strict=True):
        assert entry.stats.generated == stock_tokens(target, prompt, 8, eos=False)
        assert entry.proposer == "eagle3"
    assert sum(e.stats.drafted for e in entries) > 0
