"""MTP generation on the trained example model: lossless, skilled, and able to fail.

The example (`mtpkit/examples/tiny-qwen3_5`, trained by `scripts/train_tiny.py`) is a raw
Hugging Face Qwen3.5 checkpoint with gated-delta-net and full-attention layers and a trained
MTP head; every test converts it with `mtpkit convert` first, as a user would.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.generate import generate, measure_acceptance
from tests.stock import stock_tokens

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


def heldout_prompts(n: int, words: int = 8) -> list[str]:
    """Starts of docstrings from standard-library modules the model never trained on."""
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return [" ".join(line.split()[:words]) for line in lines[:n]]


@pytest.fixture(scope="module")
def model(converted: Path):
    return load_model(converted)


def test_example_is_a_raw_checkpoint_with_a_head(model) -> None:
    assert model.head is not None
    assert model.head_weights.layout == "sidecar"
    assert model.hidden == "post_norm"
    assert any(layer.is_linear for layer in model.model.layers)
    assert any(not layer.is_linear for layer in model.model.layers)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_greedy_is_token_for_token_stock_mlx_lm(model, converted: Path, depth: int) -> None:
    total_drafted = 0
    for text in heldout_prompts(3):
        prompt = encode_prompt(model.tokenizer, text)
        reference = stock_tokens(converted, prompt, 40)
        plain = generate(model, prompt, max_tokens=40, mtp=False)
        drafted = generate(model, prompt, max_tokens=40, depth=depth, adaptive=False)
        assert plain.tokens == reference
        assert drafted.tokens == reference
        # Every counted draft stands for an output position (an EOS draft counts as none:
        # the first prompt's output is empty).
        assert drafted.accepted <= len(reference)
        total_drafted += drafted.drafted
    assert total_drafted > 0


def test_adaptive_depth_goes_deeper_with_a_good_head_and_stops_a_useless_one(
    model, converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive drafting choosing the depth (generate's default): the example's head, which
    keeps ~95% of its first two drafts, is drafted mostly deeper than 1; a head whose drafts
    are always wrong (oracle drafts at acceptance 0) drafts FIRST_ROUNDS rounds at depth 1
    and then plain steps. Both stay token for token stock mlx-lm's (fresh load, no EOS)."""
    from mtpkit.bench.speed import DEFAULT_PROMPT
    from mtpkit.speculative.adaptive import FIRST_ROUNDS
    from mtpkit.speculative.oracle import OracleDrafts

    prompt = encode_prompt(model.tokenizer, DEFAULT_PROMPT)
    stock_model, tokenizer = mlx_lm.load(str(converted))
    tokenizer.eos_token_ids = []
    stream = mlx_lm.stream_generate(stock_model, tokenizer, mx.array(prompt), max_tokens=96)
    reference = [r.token for r in stream]
    monkeypatch.setattr(model.tokenizer, "eos_token_ids", [])
    vocab = model.embedding.weight.shape[0]
    for useless in (False, True):
        oracle = OracleDrafts(reference, len(prompt), 0.0, vocab) if useless else None
        decoder = MtpDecoder(model, prompt, depth=3, sampling=SamplingSettings(),
                             adaptive=True, choose_depth=True, draft_filter=oracle)  # fmt: skip
        assert list(decoder.tokens(96)) == reference
        by_depth = decoder.stats.rounds_by_depth[:3]
        if useless:
            assert by_depth == [FIRST_ROUNDS, 0, 0] and decoder.stats.plain_steps > 80
        else:
            assert by_depth[1] + by_depth[2] > 2 * by_depth[0] and by_depth[0] >= 1


def test_plain_steps_after_drafting_stops_are_queued_ahead(
    model, converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once adaptive drafting stops a useless head (oracle drafts at acceptance 0), its plain
    steps run as `--no-mtp`'s (mlx-lm's loop): the first is launched before the next is
    built, every later one finds its forward queued, up to the last token; no round is
    built ahead on the premise of a head that never kept a draft. Tokens stay stock's."""
    from mtpkit.bench.speed import DEFAULT_PROMPT
    from mtpkit.speculative.adaptive import FIRST_ROUNDS
    from mtpkit.speculative.look_ahead import LookAhead
    from mtpkit.speculative.oracle import OracleDrafts

    prompt = encode_prompt(model.tokenizer, DEFAULT_PROMPT)
    n = 40
    stock_model, tokenizer = mlx_lm.load(str(converted))
    tokenizer.eos_token_ids = []
    stream = mlx_lm.stream_generate(stock_model, tokenizer, mx.array(prompt), max_tokens=n)
    reference = [r.token for r in stream]
    monkeypatch.setattr(model.tokenizer, "eos_token_ids", [])
    oracle = OracleDrafts(reference, len(prompt), 0.0, model.embedding.weight.shape[0])
    decoder = MtpDecoder(model, prompt, depth=3, sampling=SamplingSettings(), adaptive=True,
                         choose_depth=True, draft_filter=oracle)  # fmt: skip
    decoder.look = LookAhead(None)  # looks ahead as on a GPU
    events: list[str] = []
    plain_step, launch = decoder.plain_step, mx.async_eval

    def watched_step(ahead: bool = False) -> list[int]:
        events.append("queued" if decoder._ahead is not None else "built")
        return plain_step(ahead)

    def watched_launch(*arrays: mx.array) -> None:
        if events and events[-1] == "built":
            events.append("launched")  # the step's own forward, before the next is built
        launch(*arrays)

    monkeypatch.setattr(decoder, "plain_step", watched_step)
    monkeypatch.setattr(mx, "async_eval", watched_launch)
    assert list(decoder.tokens(n)) == reference
    assert decoder.stats.rounds == FIRST_ROUNDS and decoder.stats.pipelined == 0
    assert events == ["built", "launched"] + ["queued"] * (n - FIRST_ROUNDS - 1)


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_is_stock_with_the_verify_attention_from_ops(
    model, converted: Path, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """The verify pass and the head's step with attention by `attention_by_ops` (what CUDA
    runs: `runtime/kernels/attention.py`, forced here) decode stock mlx-lm's greedy text."""
    from mtpkit.runtime.kernels import attention

    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    used = []
    by_ops = attention.attention_by_ops
    monkeypatch.setattr(
        attention, "attention_by_ops", lambda *a, **kw: used.append(1) or by_ops(*a, **kw)
    )
    for text in heldout_prompts(2):
        prompt = encode_prompt(model.tokenizer, text)
        reference = stock_tokens(converted, prompt, 40)
        assert (
            generate(model, prompt, max_tokens=40, depth=depth, adaptive=False).tokens == reference
        )
    assert used  # the full-attention layer's verify and the head's attention took it


def test_greedy_identity_with_adaptive_switching(model, converted: Path) -> None:
    prompt = encode_prompt(model.tokenizer, heldout_prompts(1)[0])
    result = generate(model, prompt, max_tokens=60, depth=2, adaptive=True)
    assert result.tokens == stock_tokens(converted, prompt, 60)


def test_acceptance_on_heldout_text_is_well_above_chance(converted: Path) -> None:
    acceptance = measure_acceptance(converted, heldout_prompts(8), max_tokens=48)
    assert acceptance >= 0.40


def test_acceptance_is_what_the_head_predicts(model) -> None:
    """Recount acceptance independently: run the backbone over the final sequence in one
    pass (no caches), then the head over every position in one pass, and compare the head's
    argmax with the token that actually followed wherever the decoder drafted."""
    prompt = encode_prompt(model.tokenizer, heldout_prompts(2)[1])
    decoder = MtpDecoder(model, prompt, depth=1, sampling=SamplingSettings(), adaptive=False)
    eos, model.tokenizer.eos_token_ids = model.tokenizer.eos_token_ids, []
    try:
        generated = list(decoder.tokens(48))
    finally:
        model.tokenizer.eos_token_ids = eos
    assert len(generated) == 48
    sequence = prompt + generated
    model.model(mx.array(sequence)[None])
    hidden = model.hidden_state()
    embedded = model.embed(mx.array(sequence[1:])[None])
    x = model.head(hidden[:, :-1], embedded)
    predicted = mx.argmax(model.lm_head(model.head.final_norm(0)(x)), axis=-1)[0].tolist()
    # predicted[k] is the head's guess for sequence[k + 2].
    matches = 0
    for position, drafts in decoder.stats.draft_log:
        assert drafts == [predicted[position - 2]]
        matches += position < len(sequence) and drafts[0] == sequence[position]
    assert decoder.stats.drafted == len(decoder.stats.draft_log) > 10
    assert decoder.stats.accepted == matches > 0


def test_broken_conversions_collapse_acceptance(converted: Path) -> None:
    prompts = heldout_prompts(4)
    good = measure_acceptance(converted, prompts, max_tokens=32)
    no_shift = measure_acceptance(converted, prompts, max_tokens=32, norm_shift=-1.0)
    swapped = measure_acceptance(converted, prompts, max_tokens=32, concat_order="hidden_first")
    assert good >= 0.40
    assert no_shift < good / 3
    assert swapped < good / 3


def test_sampling_is_reproducible_with_a_seed(model) -> None:
    """Seeded runs repeat exactly without adaptive drafting (whose switches follow timings)."""
    prompt = encode_prompt(model.tokenizer, heldout_prompts(1)[0])
    runs = [
        generate(
            model, prompt, max_tokens=30, temp=0.8, top_p=0.95, seed=3, depth=2, adaptive=False
        )
        for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert 0 < len(runs[0].tokens) <= 30 and runs[0].drafted > 0


def test_chained_drafts_are_the_head_applied_to_its_own_output(model) -> None:
    """At depth 2 the second draft is the head run on its own (final-normed) output and the
    first draft, after every confirmed pair: recomputed here without any cache."""
    prompt = encode_prompt(model.tokenizer, heldout_prompts(3)[2])
    decoder = MtpDecoder(model, prompt, depth=2, sampling=SamplingSettings(), adaptive=False)
    eos, model.tokenizer.eos_token_ids = model.tokenizer.eos_token_ids, []
    try:
        sequence = prompt + list(decoder.tokens(40))
    finally:
        model.tokenizer.eos_token_ids = eos
    model.model(mx.array(sequence)[None])
    hidden = model.hidden_state()
    head, norm = model.head, model.head.final_norm(0)
    for position, (d1, d2) in decoder.stats.draft_log[:12]:
        # Pairs (h_k, t_{k+1}) for k = 0 .. position - 2; the last one drafts d1.
        tokens = sequence[1:position]
        x = head(hidden[:, : position - 1], model.embed(mx.array(tokens)[None]))
        last = norm(x[:, -1:])
        assert mx.argmax(model.lm_head(last)[0, -1]).item() == d1
        x2 = head(
            mx.concatenate([hidden[:, : position - 1], last], axis=1),
            model.embed(mx.array(tokens + [d1])[None]),
        )
        assert mx.argmax(model.lm_head(norm(x2[:, -1:]))[0, -1]).item() == d2


def test_adaptive_drafting_decides_from_the_yield_and_never_from_one_round() -> None:
    from mtpkit.speculative.adaptive import FIRST_ROUNDS, RETRY_ROUNDS, AdaptiveDrafting

    def run(yields: list[int], cost: float = 1.6, a=None, **kw) -> AdaptiveDrafting:
        a = a or AdaptiveDrafting(enabled=True, cost=cost, **kw)
        for emitted in yields:
            while not a.want_draft():
                a.record_plain(1.0)
            a.record_round(emitted, 1.0)
        return a

    # A useless head: judged after its first rounds, paused for 256 tokens (barren).
    useless = run([1] * FIRST_ROUNDS)
    assert not useless.want_draft() and useless.plain_left == 256
    assert useless.plain_ahead() == 255  # the stretch's plain steps are queued one ahead
    # Retried after the stretch, on RETRY_ROUNDS rounds of its own; still useless: 512.
    useless = run([1] * RETRY_ROUNDS, a=useless)
    assert useless.plain_left == 512
    # A head that pays (1.9 tokens a round at a cost of 1.6 steps) keeps drafting; a single
    # bad round (or a slow one: rounds are not timed here) does not switch it off.
    winning = run([2, 2, 2, 2, 2, 2, 2, 2, 2, 1] * 5 + [1])
    assert winning.want_draft()
    # One that yields less than a round costs is paused for 32 tokens, doubling.
    losing = run([2, 1, 1, 1])
    assert not losing.want_draft() and losing.plain_left == 32
    losing = run([1, 1, 2], a=losing)
    assert losing.plain_left == 64
    # Greedy runs refine the cost by the wall clock, medians of many steps: rounds that cost
    # 3 plain steps make a 2-token yield lose, though the prior (1.6) says it pays.
    timed = AdaptiveDrafting(enabled=True, cost=1.6, timed=True)
    for _ in range(8):
        timed.record_plain(1.0)
        timed.record_plain(1.0)
    for _ in range(8):
        timed.record_round(2, 3.0)
    assert timed.cost() == 3.0 and not timed.want_draft()



def test_adaptive_round_cost_by_the_clock_ignores_stalls() -> None:
    """The timed round cost is the ratio of steady costs (lower quartiles): stalls in half the
    rounds and a sixth of the plain steps (first-use builds, a noisy neighbour) leave it at
    1.2, and 2-token rounds keep drafting (a median would put it near 20)."""
    from mtpkit.speculative.adaptive import AdaptiveDrafting, steady

    assert steady([5.0, 1.0, 9.0, 2.0, 30.0]) == 2.0
    timed = AdaptiveDrafting(enabled=True, cost=1.5, timed=True)
    for i in range(12):
        timed.record_plain(20.0 if i % 3 == 0 else 1.0)
        timed.record_plain(1.0)
    for i in range(12):
        timed.record_round(2, 40.0 if i % 2 == 0 else 1.2)
    assert timed.cost() == 1.2 and timed.want_draft()


def test_adaptive_depth_follows_the_acceptance_of_each_depths_rounds() -> None:
    """choose_depth: start at depth 1; a head that keeps its first draft is tried deeper (an
    unseen draft borrows the one before it); a depth is then judged on its own rounds'
    counts, so a depth that deeper rounds underrate is still tried (the bundled example's
    periodic text); neighbours are probed in turn every PROBE_EVERY rounds; a head that
    keeps nothing is paused."""
    from mtpkit.speculative.adaptive import (
        FIRST_ROUNDS,
        MIN_OBSERVED,
        PROBE_EVERY,
        AdaptiveDrafting,
    )

    a = AdaptiveDrafting(enabled=True, depth=3, choose_depth=True)
    a.priors = {1: 1.3, 2: 1.55, 3: 1.8}  # the GPU prior, whatever runs the test
    assert a.next_depth() == 1
    for _ in range(FIRST_ROUNDS):
        a.record_round(2, depth=1)  # every first draft kept
    assert a.next_depth() == 3  # drafts 2 and 3 borrow the first's 100%
    for emitted in [4, 2] * (MIN_OBSERVED // 2):  # depth 3 keeps its second draft half
        assert a.next_depth() == 3  # the time (the third, unseen 4 times, borrows 50%)
        a.record_round(emitted, depth=3)
    assert a.acceptance(3) == [1.0, 0.5, 0.5] and a.expected(3) == 2.75  # 1.53 a step
    # Depth 2, never drafted, is estimated from rounds no deeper (none: it borrows 100%),
    # so it is tried, and kept where its own rounds keep the second draft (3 / 1.55).
    assert a.acceptance(2) == [1.0, 1.0] and a.next_depth() == 2
    for _ in range(MIN_OBSERVED):
        a.record_round(3, depth=2)
    assert a.expected(2) == 3.0 and a.expected(3) == 2.75 and a.next_depth() == 2
    probes = []
    for _ in range(3 * PROBE_EVERY):
        depth = a.next_depth()
        if depth != 2:
            probes.append(depth)
        a.record_round(min(depth + 1, 3), depth=depth)
    assert probes[:2] == [3, 1] and set(probes) == {1, 3}  # one deeper, one shallower, in turn
    assert a.next_depth() == 2
    useless = AdaptiveDrafting(enabled=True, depth=3, choose_depth=True)
    for _ in range(FIRST_ROUNDS):
        useless.record_round(1, depth=useless.next_depth())
    assert not useless.want_draft() and useless.plain_left == 256
    fixed = AdaptiveDrafting(enabled=True, depth=3)  # --depth 3: every round at 3
    for _ in range(40):
        fixed.record_round(2, depth=fixed.next_depth())
        assert fixed.next_depth() == 3


def test_adaptive_decisions_are_reproducible_without_timing() -> None:
    """A sampled run's decisions depend on the yields only: the same yields with any round
    times give the same decisions."""
    from mtpkit.speculative.adaptive import AdaptiveDrafting

    yields = [1, 2, 1, 1, 1, 3, 1, 1, 2, 1, 1, 1] * 6
    runs = []
    for seconds in (0.001, 5.0):
        a = AdaptiveDrafting(enabled=True, depth=2, cost=1.9)
        decisions = []
        for emitted in yields:
            while not a.want_draft():
                decisions.append("plain")
                a.record_plain(seconds)
            decisions.append("draft")
            a.record_round(emitted, seconds * 3)
        runs.append(decisions)
    assert runs[0] == runs[1] and "plain" in runs[0]


def test_the_raw_checkpoint_runs_directly(converted: Path) -> None:
    """mlx-lm loads the raw example itself; mtpkit reads its zero-centred head (every norm
    shifted, the pre-projection norms included) and matches the converted model."""
    raw = load_model(EXAMPLE)
    assert raw.head_weights.layout == "raw_hf"
    prompts = heldout_prompts(6)
    assert (
        abs(
            measure_acceptance(EXAMPLE, prompts, max_tokens=32)
            - measure_acceptance(converted, prompts, max_tokens=32)
        )
        < 0.1
    )
    prompt = encode_prompt(raw.tokenizer, prompts[0])
    assert generate(raw, prompt, max_tokens=30, depth=2, adaptive=False).tokens == stock_tokens(
        EXAMPLE, prompt, 30
    )
