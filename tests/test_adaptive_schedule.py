"""Adaptive drafting's schedule once drafting loses (issue 46): parking after repeated or
clear losses, probes of a losing depth backed off, and a greedy engine's requests going on
from the last clear losing verdict. The decisions are checked on their counts; the decoding
against stock mlx-lm's greedy tokens (a fresh load, no EOS)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.bench.speed import DEFAULT_PROMPT
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.adaptive import (
    FIRST_ROUNDS,
    MAX_PARKED_STRETCH,
    MAX_PROBE_EVERY,
    PARK_LOSSES,
    PARKED_STRETCH,
    PROBE_EVERY,
    RETRY_ROUNDS,
    AdaptiveDrafting,
    DraftingMemory,
)
from mtpkit.speculative.decode import MtpDecoder
from mtpkit.speculative.oracle import OracleDrafts
from mtpkit.speculative.proposers import default_proposer
from mtpkit.speculative.session import Engine, Request


def judged(a: AdaptiveDrafting, yields: list[int]) -> list[int]:
    """Feed `yields` as rounds (plain steps between them as the schedule asks); the
    stretches of plain steps it asked for, in order."""
    stretches = []
    for emitted in yields:
        if not a.want_draft():
            stretches.append(a.plain_left)
            while not a.want_draft():
                a.record_plain(1.0)
        a.record_round(emitted, 1.0)
    if not a.want_draft():
        stretches.append(a.plain_left)
    return stretches


def test_a_barren_head_is_parked_after_four_clear_losses() -> None:
    """No draft ever kept: 256, 512, 1024 plain steps between retries, then parked (the
    fourth clear loss): PARKED_STRETCH, doubling to MAX_PARKED_STRETCH; a retry that wins
    unparks it."""
    a = AdaptiveDrafting(enabled=True, cost=1.6)
    stretches = judged(a, [1] * (FIRST_ROUNDS + 7 * RETRY_ROUNDS))
    assert stretches == [256, 512, 1024, 4096, 8192, 16384, 32768, 32768]
    assert a.parked and stretches[3] == PARKED_STRETCH and stretches[-1] == MAX_PARKED_STRETCH
    while not a.want_draft():
        a.record_plain(1.0)
    assert judged(a, [3] * RETRY_ROUNDS) == [] and not a.parked and a.losses == 0
    # Eight rounds of one token pull the window's mean (3, 3, 3, 1, ...) under 1.6: a loss
    # after the win starts the short stretches again.
    assert judged(a, [1] * 8) == [32] and a.losses == 1


def test_a_head_that_loses_sixteen_times_is_parked() -> None:
    """A head that keeps a draft now and then but never pays (1.5 tokens a round at a cost
    of 1.6): stretches of 32 doubling to 1024, and at the PARK_LOSSES-th losing decision
    the parked stretch."""
    a = AdaptiveDrafting(enabled=True, cost=1.6)
    stretches = judged(a, [2, 1, 2, 1] + [2, 1, 1] * (PARK_LOSSES + 1))
    assert stretches[:6] == [32, 64, 128, 256, 512, 1024]
    assert stretches[6 : PARK_LOSSES - 1] == [1024] * (PARK_LOSSES - 7)
    assert stretches[PARK_LOSSES - 1 :][:2] == [PARKED_STRETCH, 2 * PARKED_STRETCH]


def test_a_probed_depth_that_loses_is_probed_less_often() -> None:
    """Depth 2 chosen and paying; probes of 3 and of 1 that never win their depth: the rounds
    between probes each way double from PROBE_EVERY to MAX_PROBE_EVERY (every PROBE_EVERY
    rounds before: ~120 probes in these 4000 rounds, 13 now); once the third draft is kept,
    a deeper probe that keeps it brings the next one sooner, and depth 3 wins again."""
    a = AdaptiveDrafting(enabled=True, depth=3, choose_depth=True)
    a.priors = {1: 1.3, 2: 1.55, 3: 1.8}  # the GPU prior, whatever runs the test
    probes: list[tuple[int, int]] = []
    for i in range(4000):
        depth = a.next_depth()
        if i >= FIRST_ROUNDS and depth != a.depth:
            probes.append((i, depth))
        a.record_round(min(depth, 2) + 1, depth=depth)  # depths 1-2 kept, the third never
    assert a.depth == 2 and [d for _, d in probes] == [3, 1] * 6 + [3]
    gaps = [j - i for (i, _), (j, _) in zip(probes, probes[1:], strict=False)]
    assert gaps == [k + 1 for k in [32, 64, 64, 128, 128, 256, 256] + [MAX_PROBE_EVERY] * 5]
    assert a.probe_every == {1: MAX_PROBE_EVERY, -1: MAX_PROBE_EVERY}
    rounds = 0
    while a.depth != 3 and rounds < 3000:  # every draft kept from now on
        depth = a.next_depth()
        a.record_round(depth + 1, depth=depth)
        rounds += 1
    assert a.depth == 3 and rounds < 2000
    assert a.probe_every == {1: PROBE_EVERY, -1: PROBE_EVERY}


def test_a_clear_losing_verdict_is_remembered_for_the_next_request() -> None:
    """A greedy request that ends while its head loses without a draft ever kept leaves the
    schedule: the next one goes on with the rest of the stretch, then a retry of
    RETRY_ROUNDS rounds; a request that ends winning leaves nothing, and so does one whose
    head kept some drafts and still lost (judged afresh next time)."""
    memory = DraftingMemory()
    first = AdaptiveDrafting(enabled=True, cost=1.6)
    judged(first, [1] * FIRST_ROUNDS)
    for _ in range(100):
        first.record_plain(1.0)
    first.remember(memory)
    second = AdaptiveDrafting(enabled=True, cost=1.6)
    second.resume(memory)
    assert not second.want_draft() and second.plain_left == 256 - 100
    assert judged(second, [1] * RETRY_ROUNDS) == [156, 512]
    winner = AdaptiveDrafting(enabled=True, cost=1.6)
    winner.resume(memory)
    while not winner.want_draft():
        winner.record_plain(1.0)
    judged(winner, [3] * RETRY_ROUNDS)
    winner.remember(memory)
    assert memory.schedule is None
    fresh = AdaptiveDrafting(enabled=True, cost=1.6)
    fresh.resume(memory)
    assert fresh.want_draft() and fresh.need == FIRST_ROUNDS
    first.remember(memory)
    assert memory.schedule is not None
    weak = AdaptiveDrafting(enabled=True, cost=1.6)
    assert judged(weak, [2, 1, 1, 1]) == [32]  # it lost, a draft kept
    weak.remember(memory)
    assert memory.schedule is None


@pytest.fixture(scope="module")
def useless(converted: Path):
    """The example, stock's greedy tokens for the bench prompt, and an oracle proposer
    factory whose drafts are never right (acceptance 0)."""
    m = load_model(converted)
    prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT)
    stock_model, tokenizer = mlx_lm.load(str(converted))
    tokenizer.eos_token_ids = []
    stream = mlx_lm.stream_generate(stock_model, tokenizer, mx.array(prompt), max_tokens=48)
    reference = [r.token for r in stream]
    vocab = m.embedding.weight.shape[0]

    class Useless:
        name = "mtp"

        def __call__(self):
            return OracleDrafts(reference, len(prompt), 0.0, vocab).proposer(default_proposer(m))

    return m, prompt, reference, Useless()


def test_an_engine_goes_on_from_the_last_greedy_verdict(useless, monkeypatch) -> None:
    """Two greedy requests on one engine whose head never drafts right: the first judges it
    in FIRST_ROUNDS rounds, the second takes plain steps only (the rest of the stretch);
    both decode stock's tokens. A sampled request neither reads nor leaves the verdict."""
    m, prompt, reference, proposers = useless
    monkeypatch.setattr(m.tokenizer, "eos_token_ids", [])
    engine = Engine(m, prompt_cache_size=0)
    engine.proposers = proposers
    runs = []
    for _ in range(2):
        session = engine.session(Request(prompt, max_tokens=40))
        runs.append(session)
        assert [e.token for e in session][:40] == reference[:40]
    assert runs[0].stats.rounds == FIRST_ROUNDS and runs[1].stats.rounds == 0
    assert runs[1].stats.plain_steps == 40
    (memory,) = engine.drafting_memory.values()
    assert memory.schedule["plain_left"] == 256 - (40 - FIRST_ROUNDS) - 40
    sampled = engine.session(Request(prompt, max_tokens=4, sampling=SamplingSettings(temp=1.0)))
    assert sampled.decoder.memory is None and sampled.decoder.adaptive.want_draft()


def test_a_decoder_without_memory_judges_afresh(useless, monkeypatch) -> None:
    """MtpDecoder without `memory` (bench's runs, `generate`): every run judges its first
    rounds, as before."""
    m, prompt, reference, proposers = useless
    monkeypatch.setattr(m.tokenizer, "eos_token_ids", [])
    for _ in range(2):
        decoder = MtpDecoder(m, prompt, depth=3, sampling=SamplingSettings(), adaptive=True,
                             choose_depth=True, proposer=proposers())  # fmt: skip
        assert list(decoder.tokens(40)) == reference[:40]
        assert decoder.stats.rounds == FIRST_ROUNDS


def test_a_parked_head_is_not_kept_warm(useless, converted: Path, monkeypatch) -> None:
    """Parked (a session resumed parked, 300 plain steps left), the head runs over none of
    the plain steps' pairs: it never catches up, keeps at most CATCH_UP_AFTER pending, and
    its retry drafts from the last RESTING_PAIRS of them, so its cache misses the pairs in
    between. The tokens stay stock's throughout, the retry's rounds included."""
    from mtpkit.speculative.proposers.mtp_head import CATCH_UP_AFTER, RESTING_PAIRS, HeadProposer

    m, prompt, _, proposers = useless
    n = 300 + RETRY_ROUNDS + 4
    stock_model, tokenizer = mlx_lm.load(str(converted))
    tokenizer.eos_token_ids = []
    stream = mlx_lm.stream_generate(stock_model, tokenizer, mx.array(prompt), max_tokens=n)
    reference = [r.token for r in stream]
    monkeypatch.setattr(m.tokenizer, "eos_token_ids", [])
    parked = AdaptiveDrafting(enabled=True)
    parked.parked, parked.losses, parked.plain_left = True, PARK_LOSSES, 300
    memory = DraftingMemory()
    parked.remember(memory)
    proposer = proposers()
    head = proposer.inner
    catch_ups, most_pending = [], [0]
    catch_up = HeadProposer.catch_up
    monkeypatch.setattr(HeadProposer, "catch_up",
                        lambda self, keep_last=True: catch_ups.append(1) or catch_up(self, keep_last))  # fmt: skip
    observe = head.observe

    def watched(hidden, tokens):
        observe(hidden, tokens)
        most_pending[0] = max(most_pending[0], len(head.pending_tokens))

    head.observe = watched
    decoder = MtpDecoder(m, prompt, depth=1, sampling=SamplingSettings(), adaptive=True,
                         proposer=proposer, memory=memory)  # fmt: skip
    assert list(decoder.tokens(n)) == reference
    assert decoder.stats.plain_steps >= 300 and decoder.stats.rounds == RETRY_ROUNDS
    assert catch_ups == [1]  # the prompt's, at the end of the prefill; none after
    assert most_pending[0] == CATCH_UP_AFTER  # then the last RESTING_PAIRS
    # The head's cache: the prompt's pairs, the RESTING_PAIRS kept at the drop and the 44
    # after it, the retry rounds' pairs; a warm head's holds every one of the 300 steps'.
    dropped = CATCH_UP_AFTER - RESTING_PAIRS
    assert head.cache[0].offset <= len(prompt) + 300 - dropped + 2 * RETRY_ROUNDS + 2


def test_a_round_shallower_by_two_is_judged_as_a_probe() -> None:
    """A proposer may draft fewer tokens than asked (prompt lookup): a round two shallower
    than the chosen depth counts as a shallower probe."""
    a = AdaptiveDrafting(enabled=True, depth=3, choose_depth=True)
    a.priors = {1: 1.3, 2: 1.55, 3: 1.8}
    for _ in range(FIRST_ROUNDS + 2):  # every draft kept: depth 3
        depth = a.next_depth()
        a.record_round(depth + 1, depth=depth)
    assert a.depth == 3
    a.record_round(2, depth=1)  # asked for 3, found 1
    assert a.since_probe == 0 and a.probe_deeper and a.depth == 3
