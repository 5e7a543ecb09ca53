"""The prompt cache across turns, in a batch and in one stream: a request joins from the
cached state of the longest sequence its prompt extends, and a finished request leaves its
state there (its prompt, its output and the EOS that ended it, not what its last round
confirmed past its end).

Proved against computations done another way: every row's greedy tokens are stock mlx-lm's
for its whole prompt alone (a fresh load, no cache), for every cache kind a row is taken out
of the batch in (KV with per-row offsets, gated delta nets, sliding windows, Mamba, MLA,
cache lists); and on the bundled example (a trained head) every draft a row verified after
joining from an entry is the head's argmax over the row's whole sequence run in one pass
without caches, so the head state the entry kept (pending pairs or its output at the last
pair) is exactly the row's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.speculative.batch import BatchDecoder, Row
from mtpkit.speculative.prompt_cache import PromptCache
from mtpkit.speculative.proposers.mtp_head import HeadProposer
from tests.test_batch import LAYOUTS, UNEQUAL, Schedule, m, model_dir, stock  # noqa: F401
from tests.test_batch_head import (
    EXAMPLE,
    TEXTS,
    eos_inside_a_round,
    head_predictions,
    round_of_fresh_tokens,
)


def entry_of(cache: PromptCache, tokens: list[int]):
    return cache.entries[tuple(tokens)]


@pytest.mark.parametrize(
    "model_dir",
    [*LAYOUTS, "exaone_moe", "nemotron_h", "deepseek_v3", "deepseek_v32"],
    indirect=True,
)
def test_next_turns_join_from_the_cache_and_stay_stock(m, stock) -> None:  # noqa: F811
    """A row that finished while another decodes leaves its whole state; a next turn joins
    from it (prefilling only what it adds) and a repeated prompt from the prompt's own
    state, while the first turn's other row still decodes; each is its prompt's single
    stream from scratch."""
    cache = PromptCache(10)
    decoder = BatchDecoder(m, depth=2, prompt_cache=cache)
    decoder.eos = set()
    short = decoder.add(UNEQUAL[0], max_tokens=9)
    long = decoder.add(UNEQUAL[2], max_tokens=40)
    while not short.done:
        decoder.step()
    key = UNEQUAL[0] + short.decoded
    assert short.decoded == short.tokens  # not what its last round confirmed past its end
    entry = entry_of(cache, key)
    assert isinstance(entry.proposer, HeadProposer)
    turn = [*key, 11, 12, 13]
    hit = cache.longest_prefix(turn, "mtp")
    assert hit is entry
    follow = decoder.add(turn, max_tokens=20, cached=hit)
    again = decoder.add(UNEQUAL[2], max_tokens=20, cached=cache.longest_prefix(UNEQUAL[2], "mtp"))
    while decoder.rows:
        decoder.step()
    assert follow.stats.cached_tokens == len(key) - 1
    assert again.stats.cached_tokens == len(UNEQUAL[2]) - 1
    assert long.stats.cached_tokens == short.stats.cached_tokens == 0
    assert follow.tokens == stock(turn, 20, eos=False)
    assert again.tokens == stock(UNEQUAL[2], 20, eos=False)
    assert long.tokens == stock(UNEQUAL[2], 40, eos=False)
    assert follow.rounds > 0 and again.rounds > 0


def test_an_entry_extends_nothing_it_does_not_hold(m) -> None:  # noqa: F811
    """A prompt that does not extend an entry's tokens, or an entry of another kind of
    state, is prefilled from its first token."""
    cache = PromptCache(10)
    decoder = BatchDecoder(m, depth=1, prompt_cache=cache)
    decoder.add(UNEQUAL[2], max_tokens=4)
    while decoder.rows:
        decoder.step()
    entry = cache.longest_prefix(UNEQUAL[2], "mtp")
    other = [*UNEQUAL[2][:-1], UNEQUAL[2][-1] + 1]
    row = decoder.add(other, max_tokens=2, cached=entry)
    assert row.stats.cached_tokens == 0
    entry.proposer = None  # a plain session's entry: no head state to continue
    row = decoder.add(UNEQUAL[2], max_tokens=2, cached=entry)
    assert row.stats.cached_tokens == 0


@pytest.fixture(scope="module")
def example():
    from mtpkit.runtime.model import load_model

    return load_model(EXAMPLE)


@pytest.fixture(scope="module")
def stock_tokens():
    """stock_tokens(prompt, n): stock mlx-lm's first `n` greedy tokens of `prompt` alone on
    the example, EOS or not."""
    model, tokenizer = mlx_lm.load(str(EXAMPLE))
    tokenizer.eos_token_ids = []

    def tokens(prompt: list[int], n: int) -> list[int]:
        stream = mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n)
        return [r.token for r in stream]

    return tokens


def until_done(decoder: BatchDecoder, row: Row, eos_at: tuple[Row, int, int] | None = None):
    """Steps until `row` is done; with `eos_at` (a row, its token index, the token), that
    token is the EOS for the one step that confirms it."""
    while not row.done:
        decoder.eos = set()
        if eos_at is not None and len(eos_at[0].tokens) == eos_at[1]:
            decoder.eos = {eos_at[2]}
        decoder.step()
    decoder.eos = set()


def test_rows_from_entries_draft_the_heads_predictions(example, stock_tokens) -> None:
    """Entries of every head state: a row that ended in a round (the head's output at its
    last pair), one that ended at its max_tokens in plain steps (pairs pending), one that met
    an EOS while the next plain step was queued (its entry takes that step's token and
    pair), and a prompt's own state. Next turns join from each while other rows decode:
    their tokens are stock's and each of their drafts is the head's own prediction."""
    cache = PromptCache(20)
    decoder = BatchDecoder(example, depth=1, prompt_cache=cache)
    decoder.eos = set()
    prompts = [example.tokenizer.encode(t) for t in TEXTS]
    in_round = decoder.add(prompts[0], max_tokens=10)
    busy = decoder.add(prompts[1], max_tokens=120)
    until_done(decoder, in_round)  # every step a round
    assert entry_of(cache, prompts[0] + in_round.decoded).proposer.ready is not None

    decoder.policy = Schedule([False])  # plain steps from here, queued one ahead
    by_length = decoder.add(prompts[2], max_tokens=6)
    ended = decoder.add(prompts[3], max_tokens=60)
    ref = stock_tokens(prompts[3], 30)
    busy_ref = stock_tokens(prompts[1], 120)
    # An EOS for `ended` at a token it has not had before, that `busy` does not confirm in
    # the same plain step (`by_length` leaves after 5 steps, before it).
    k = next(
        k for k in range(8, 30)
        if ref[k] not in ref[:k] and busy_ref[len(busy.tokens) + k - 1] != ref[k]
    )  # fmt: skip
    until_done(decoder, by_length)
    plain_entry = entry_of(cache, prompts[2] + by_length.decoded)
    assert plain_entry.proposer.pending_tokens and plain_entry.proposer.ready is None
    until_done(decoder, ended, (ended, k, ref[k]))
    assert ended.finish == "stop" and ended.tokens == ref[:k]
    # Its caches hold the EOS and the queued step's token: the entry's key ends with both.
    eos_entry = entry_of(cache, prompts[3] + ref[: k + 2])
    assert eos_entry.proposer.pending_tokens[-2:] == ref[k : k + 2]

    decoder.policy = Schedule([True, True, False])  # rounds, and plain steps between them
    extra = example.tokenizer.encode(" and then")
    turns = [
        prompts[0] + in_round.decoded + extra,
        prompts[2] + by_length.decoded + extra,
        prompts[3] + ref[: k + 2] + extra,
        prompts[1],  # the prompt's own state (`busy` still decodes)
    ]
    hits = [cache.longest_prefix(t, "mtp") for t in turns]
    rows = [decoder.add(t, max_tokens=24, cached=h) for t, h in zip(turns, hits, strict=True)]
    assert [r.stats.cached_tokens for r in rows] == [len(h.tokens) - 1 for h in hits]
    assert [len(h.tokens) for h in hits] == [len(t) - len(extra) for t in turns[:3]] + [
        len(prompts[1])
    ]
    while decoder.rows:
        decoder.step()
    assert busy.tokens == busy_ref
    for row, turn in zip(rows, turns, strict=True):
        assert row.tokens == stock_tokens(turn, 24)
        predicted = head_predictions(example, row)
        assert row.rounds > 3
        for position, drafts in row.draft_log:
            assert drafts == [predicted[position - 2]], (row.uid, position)
    assert sum(row.accepted for row in rows) > 10


@pytest.mark.parametrize("model_dir", ["deepseek_v32"], indirect=True)
def test_one_streams_entry_of_cache_lists_is_its_own(m, stock) -> None:  # noqa: F811
    """mlx-lm's CacheList (deepseek_v32's layers) holds caches: an entry forks each of them,
    so the session that goes on after storing it changes nothing the entry holds (one
    stream's cache too, which the batch shares)."""
    from mtpkit.speculative.session import Engine, Request

    engine = Engine(m, mtp=True)
    first = [e.token for e in engine.session(Request(UNEQUAL[2], max_tokens=12))]
    second = engine.session(Request(UNEQUAL[2], max_tokens=12))
    again = [e.token for e in second if e.token is not None]
    assert second.stats.cached_tokens == len(UNEQUAL[2]) - 1
    assert again == [t for t in first if t is not None] == stock(UNEQUAL[2], 12)


def test_a_row_ending_at_an_eos_inside_a_round_keeps_its_state_up_to_the_eos(
    example, stock_tokens
) -> None:
    """An EOS as the first of two kept drafts: the round confirms tokens past it, but the
    row's caches keep its output and the EOS only (the state a conversation's next turn
    extends: prompt, answer, end of turn), and a next turn joins from there."""
    prompt = example.tokenizer.encode(TEXTS[0])
    row, start = round_of_fresh_tokens(example, prompt)
    eos = row.tokens[start]
    cache = PromptCache(4)
    decoder = BatchDecoder(example, depth=2, prompt_cache=cache)
    decoder.eos = {eos}
    ended = decoder.add(prompt, max_tokens=40)
    while decoder.rows:
        decoder.step()
    assert ended.finish == "stop" and ended.tokens == row.tokens[:start]
    assert ended.decoded == [*ended.tokens, eos]
    key = prompt + ended.decoded
    assert tuple(key) in cache.entries
    decoder.eos = set()
    turn = key + example.tokenizer.encode(" and then")
    follow = decoder.add(turn, max_tokens=20, cached=cache.longest_prefix(turn, "mtp"))
    while decoder.rows:
        decoder.step()
    assert follow.stats.cached_tokens == len(key) - 1
    assert follow.tokens == stock_tokens(turn, 20)
    predicted = head_predictions(example, follow)
    for position, drafts in follow.draft_log:
        assert drafts[0] == predicted[position - 2]


def test_one_stream_and_a_batch_continue_each_others_entries(example, stock_tokens) -> None:
    """The engine's prompt cache is shared: a batch's row joins from a single-stream
    session's entry, and a session continues from the entry a batch's row left."""
    from mtpkit.speculative.batch.session import BatchSession
    from mtpkit.speculative.session import Engine, Request

    engine = Engine(example, mtp=True)
    prompt = example.tokenizer.encode(TEXTS[1])
    alone = engine.session(Request(prompt, max_tokens=8))
    list(alone)
    turn = prompt + alone.decoder.confirmed + example.tokenizer.encode(" and")
    batch = BatchSession(engine)
    entry = batch.add(Request(turn, max_tokens=8))
    while batch.entries:
        batch.step()
    assert entry.stats.cached_tokens == len(prompt) + len(alone.decoder.confirmed) - 1
    # Stock's tokens, up to an EOS (stock_tokens runs past it).
    assert entry.row.tokens and entry.row.tokens == stock_tokens(turn, 8)[: len(entry.row.tokens)]
    later = turn + entry.row.decoded + example.tokenizer.encode(" or")
    session = engine.session(Request(later, max_tokens=8))
    tokens = [e.token for e in session if e.token is not None]
    assert session.stats.cached_tokens == len(turn) + len(entry.row.decoded) - 1
    assert tokens and tokens == stock_tokens(later, 8)[: len(tokens)]


@pytest.mark.parametrize("at", [0, 1], ids=["first-draft", "second-draft"])
def test_one_stream_ending_inside_a_round_keeps_its_state_up_to_the_eos(
    example, stock_tokens, at: int
) -> None:
    """One stream's session too: a round that confirms tokens past the EOS keeps its caches
    up to the EOS, so the entry it leaves is its prompt, its output and the EOS, which a
    next turn extends."""
    from mtpkit.speculative.session import Engine, Request

    prompt = example.tokenizer.encode(TEXTS[0])
    with eos_inside_a_round(example, prompt, at) as (fresh, start, eos):
        engine = Engine(example, mtp=True)
        first = engine.session(Request(prompt, max_tokens=40, depth=2, adaptive=False))
        tokens = [e.token for e in first if e.token is not None]
    assert tokens == fresh[: start + at]
    # The EOS came inside a round that kept both its drafts (the round's log is cut at it).
    assert first.stats.draft_log[-1] == (len(prompt) + start, fresh[start : start + at])
    assert first.decoder.confirmed == [*tokens, eos]
    turn = prompt + first.decoder.confirmed + example.tokenizer.encode(" and then")
    second = engine.session(Request(turn, max_tokens=12, depth=2, adaptive=False))
    out = [e.token for e in second if e.token is not None]
    assert second.stats.cached_tokens == len(prompt) + len(tokens)
    assert out == stock_tokens(turn, 12)[: len(out)] and out
