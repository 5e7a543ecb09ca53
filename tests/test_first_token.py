"""The first token after a long prompt goes out before the MTP head catches up with the
prompt (issue 47's time to first token): in one stream and in a batch join, it is the
target's alone (its logits at the last prompt token), and the head's pass over the prompt's
pairs runs at the next step.

Proved against computations done another way: the tokens are stock mlx-lm's greedy tokens
for the whole prompt (a fresh load), and every draft verified after the deferred catch-up
is the head's argmax over the whole sequence run in one pass without caches
(`test_batch_head.head_predictions`), so the head's state after it is exactly a full pass's.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from mtpkit.bench.serve_load import long_prompt
from mtpkit.speculative.batch import Row
from mtpkit.speculative.batch.session import BatchSession
from mtpkit.speculative.proposers.mtp_head import CATCH_UP_AFTER, HeadProposer
from mtpkit.speculative.session import Engine, Request
from tests.stock import stock_tokens
from tests.test_batch_head import head_predictions

PROMPT_TOKENS = 2 * CATCH_UP_AFTER  # a prompt whose catch-up waits for the first token
MAX_TOKENS = 24


@pytest.fixture()
def catch_ups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pending pairs at each `HeadProposer.end_prefill`, as it runs."""
    calls: list[int] = []
    original = HeadProposer.end_prefill

    def recorded(self: HeadProposer) -> None:
        calls.append(len(self.pending_tokens))
        original(self)

    monkeypatch.setattr(HeadProposer, "end_prefill", recorded)
    return calls


def engine_without_eos(converted: Path, monkeypatch: pytest.MonkeyPatch, **kwargs) -> Engine:
    engine = Engine.load(converted, mtp=True, **kwargs)
    monkeypatch.setattr(engine.m.tokenizer, "eos_token_ids", [])
    return engine


def long_ids(engine: Engine, tokens: int = PROMPT_TOKENS) -> list[int]:
    return engine.tokenizer.encode(long_prompt(tokens))[:tokens]


def assert_drafts_are_the_heads(engine: Engine, prompt: list[int], tokens: list[int],
                                draft_log: list[tuple[int, list[int]]]) -> None:  # fmt: skip
    predicted = head_predictions(engine.m, Row(0, prompt, len(tokens), tokens=tokens))
    assert draft_log
    for position, drafts in draft_log:
        assert drafts == [predicted[position - 2]], position


def test_one_stream_sends_the_first_token_before_the_head_catches_up(
    converted: Path, monkeypatch: pytest.MonkeyPatch, catch_ups: list[int]
) -> None:
    engine = engine_without_eos(converted, monkeypatch, prompt_cache_size=0)
    prompt = long_ids(engine)
    reference = stock_tokens(converted, prompt, MAX_TOKENS, eos=False)
    session = engine.session(Request(prompt, MAX_TOKENS, depth=1, adaptive=False))
    events = iter(session)
    first = next(events)
    assert first.token == reference[0] and first.finish_reason is None
    assert catch_ups == []  # out before the head's pass over the prompt
    rest = list(events)
    assert catch_ups == [len(prompt) - 1]  # every pair of the prompt, once
    tokens = [e.token for e in [first, *rest] if e.token is not None]
    assert tokens == reference
    assert session.stats.plain_steps == 1 and session.stats.accepted > 0
    assert_drafts_are_the_heads(engine, prompt, tokens, session.stats.draft_log)


def test_a_short_prompt_still_drafts_its_first_token(
    converted: Path, monkeypatch: pytest.MonkeyPatch, catch_ups: list[int]
) -> None:
    """Below `CATCH_UP_AFTER` pairs the catch-up costs less than the tokens a first round
    drafts: the head catches up at the prefill's end and the first step is a round."""
    engine = engine_without_eos(converted, monkeypatch, prompt_cache_size=0)
    prompt = long_ids(engine, CATCH_UP_AFTER // 2)
    session = engine.session(Request(prompt, MAX_TOKENS, depth=1, adaptive=False))
    tokens = [e.token for e in session if e.token is not None]
    assert tokens == stock_tokens(converted, prompt, MAX_TOKENS, eos=False)
    assert catch_ups == [len(prompt) - 1] and session.stats.plain_steps == 0
    assert session.stats.draft_log[0][0] == len(prompt)  # the first token was drafted


def test_the_prompts_state_is_kept_after_a_deferred_catch_up(
    converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt cache's entry of the prompt holds the target's caches as the prefill left
    them and the head caught up: the same prompt again prefills one token, a next turn
    joins from the first one's end, and both draft as a full pass of the head does."""
    engine = engine_without_eos(converted, monkeypatch)
    prompt = long_ids(engine)
    first = engine.session(Request(prompt, MAX_TOKENS, depth=1, adaptive=False))
    answer = [e.token for e in first if e.token is not None]
    again = engine.session(Request(prompt, MAX_TOKENS, depth=1, adaptive=False))
    assert [e.token for e in again if e.token is not None] == answer
    assert again.stats.cached_tokens == len(prompt) - 1
    assert_drafts_are_the_heads(engine, prompt, answer, again.stats.draft_log)
    turn = prompt + answer + engine.tokenizer.encode("\n\nNext:")
    session = engine.session(Request(turn, MAX_TOKENS, depth=1, adaptive=False))
    tokens = [e.token for e in session if e.token is not None]
    assert session.stats.cached_tokens == len(prompt) + len(answer) - 1
    assert tokens == stock_tokens(converted, turn, MAX_TOKENS, eos=False)
    assert_drafts_are_the_heads(engine, turn, tokens, session.stats.draft_log)


def test_a_batch_join_sends_its_first_token_before_the_head_catches_up(
    converted: Path, monkeypatch: pytest.MonkeyPatch, catch_ups: list[int]
) -> None:
    """A long prompt joins while another request decodes: its first token is in its events
    when `add` returns, before its head's catch-up; it merges at the next step, and both
    decode as they do alone."""
    engine = engine_without_eos(converted, monkeypatch, prompt_cache_size=0)
    short = engine.tokenizer.encode("def main(argv):")
    prompt = long_ids(engine)
    batch = BatchSession(engine, adaptive=False)
    other = batch.add(Request(short, MAX_TOKENS, depth=1))
    batch.step()
    catch_ups.clear()
    entry = batch.add(Request(prompt, MAX_TOKENS, depth=1))
    reference = stock_tokens(converted, prompt, MAX_TOKENS, eos=False)
    assert [e.token for e in batch.take_events(entry)] == reference[:1]
    assert catch_ups == [] and entry.row not in batch.decoder.rows
    while batch.entries:
        batch.step()
    assert catch_ups == [len(prompt) - 1]
    assert entry.row.tokens == reference and entry.finish_reason == "length"
    assert other.row.tokens == stock_tokens(converted, short, MAX_TOKENS, eos=False)
    assert_drafts_are_the_heads(engine, prompt, entry.row.tokens, entry.row.draft_log)


def test_a_joining_row_cancelled_or_stopped_at_its_first_token(
    converted: Path, monkeypatch: pytest.MonkeyPatch, catch_ups: list[int]
) -> None:
    """Cancelled before it merges: its head never catches up and the batch goes on. Ended by
    a stop string at its first token: it catches up and leaves its prompt's state, which
    the same prompt then joins from."""
    engine = engine_without_eos(converted, monkeypatch)
    prompt = long_ids(engine)
    reference = stock_tokens(converted, prompt, MAX_TOKENS, eos=False)
    short = engine.tokenizer.encode("for i in range(10):")
    batch = BatchSession(engine, adaptive=False)
    other = batch.add(Request(short, MAX_TOKENS, depth=1))
    catch_ups.clear()  # the short prompt's, at its prefill's end
    cancelled = batch.add(Request(prompt, MAX_TOKENS, depth=1))
    batch.cancel(cancelled)
    batch.step()
    assert catch_ups == [] and cancelled.finish_reason == "cancelled"
    stop = engine.tokenizer.decode(reference[:1])
    assert stop.strip(), "the first token's text must be something to stop at"
    stopped = batch.add(Request(prompt, MAX_TOKENS, depth=1, stop=(stop,)))
    assert stopped.finish_reason == "stop" and stopped.text == ""
    assert catch_ups == [len(prompt) - 1]
    while batch.entries:
        batch.step()
    assert other.row.tokens == stock_tokens(converted, short, MAX_TOKENS, eos=False)
    again = batch.add(Request(prompt, MAX_TOKENS, depth=1))
    while batch.entries:
        batch.step()
    assert again.stats.cached_tokens == len(prompt) - 1 and again.row.tokens == reference
    assert_drafts_are_the_heads(engine, prompt, again.row.tokens, again.row.draft_log)


@pytest.mark.parametrize("concurrency", [1, 4], ids=["one-stream", "batch"])
def test_the_servers_worker_hands_the_first_token_out_before_the_catch_up(
    converted: Path, monkeypatch: pytest.MonkeyPatch, concurrency: int
) -> None:
    """The decoding thread `mtpkit serve` streams from: with the long prompt's catch-up held
    until the first token has reached the event loop, the request still gets it, then the
    rest of stock mlx-lm's tokens."""
    from mtpkit.serve.schemas import Outcome
    from mtpkit.serve.worker import Job, Worker
    from mtpkit.speculative.session import TokenEvent

    engine = engine_without_eos(converted, monkeypatch, prompt_cache_size=0)
    prompt = long_ids(engine)
    reference = stock_tokens(converted, prompt, MAX_TOKENS, eos=False)
    released, original = threading.Event(), HeadProposer.end_prefill

    def held(self: HeadProposer) -> None:
        if len(self.pending_tokens) > CATCH_UP_AFTER:
            assert released.wait(60), "the first token never reached the client"
        original(self)

    monkeypatch.setattr(HeadProposer, "end_prefill", held)
    worker = Worker(engine, capacity=2, concurrency=concurrency)
    worker.start()
    loop = asyncio.new_event_loop()
    try:
        job = Job(lambda _e: Request(prompt, MAX_TOKENS, depth=1), None, loop)
        worker.submit(job)
        first = loop.run_until_complete(asyncio.wait_for(job.events.get(), 60))
        assert isinstance(first, TokenEvent) and first.token == reference[0]
        released.set()
        items = [first]
        while not isinstance(items[-1], Outcome):
            items.append(loop.run_until_complete(asyncio.wait_for(job.events.get(), 60)))
        assert items[-1].text == engine.tokenizer.decode(reference)
        assert items[-1].mtp.drafted > 0
    finally:
        released.set()
        worker.stop()
        loop.close()
