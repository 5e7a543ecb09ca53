"""`BatchSession` from Python: requests joining a batch between rounds and leaving it
(finished, at a stop string, cancelled) each get the text and finish reason the same
request gets alone (`Session`, the single-stream path), whatever their batchmates do."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpkit.speculative.batch.session import BatchSession
from mtpkit.speculative.session import Engine, Request

PROMPTS = ["def main(argv):", "for i in range(10):", "x =", "class Parser(object):\n    def"]


@pytest.fixture(scope="module")
def engine(converted: Path) -> Engine:
    return Engine.load(converted, mtp=True, prompt_cache_size=0)


def alone(engine: Engine, request: Request) -> tuple[str, str, int]:
    session = engine.session(request)
    tokens = sum(e.token is not None for e in session)
    return session.text, session.finish_reason, tokens


def test_joins_leaves_and_stops_match_single_streams(engine: Engine) -> None:
    ids = [engine.m.tokenizer.encode(p) for p in PROMPTS]
    full = alone(engine, Request(ids[1], max_tokens=30))[0]
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    requests = [
        Request(ids[0], max_tokens=30),
        Request(ids[1], max_tokens=30, stop=(stop,)),
        Request(ids[2], max_tokens=12),
        Request(ids[3], max_tokens=30),
        Request(ids[0], max_tokens=0),
    ]
    batch = BatchSession(engine, adaptive=False)
    entries = [batch.add(r) for r in requests[:2]]
    texts = {id(e): "" for e in entries}
    for _ in range(3):  # the others join while the first two decode
        for entry in batch.step():
            texts[id(entry)] += "".join(e.text for e in batch.take_events(entry))
    assert len(batch.entries) == 2
    for request in requests[2:]:
        entry = batch.add(request)
        texts[id(entry)] = "".join(e.text for e in batch.take_events(entry))
        entries.append(entry)
    while batch.entries:
        for entry in batch.step():
            texts[id(entry)] += "".join(e.text for e in batch.take_events(entry))
    for request, entry in zip(requests, entries, strict=True):
        text, reason, tokens = alone(engine, request)
        assert (entry.text, entry.finish_reason, entry.generated) == (text, reason, tokens)
        assert texts[id(entry)] == text  # the events carry the whole text, once
    assert entries[1].text == full[: full.index(stop)] and entries[1].finish_reason == "stop"
    assert entries[4].finish_reason == "length" and entries[4].text == ""
    assert entries[0].stats.drafted > 0 and entries[0].stats.accepted <= entries[0].stats.drafted


def test_a_cancelled_request_leaves_and_the_others_finish(engine: Engine) -> None:
    ids = [engine.m.tokenizer.encode(p) for p in PROMPTS[:3]]
    batch = BatchSession(engine)
    entries = [batch.add(Request(i, max_tokens=24)) for i in ids]
    batch.step()
    batch.cancel(entries[1])
    assert entries[1].finish_reason == "cancelled"
    assert len(batch.decoder.rows) == 2 and entries[1] not in batch.entries
    while batch.entries:
        batch.step()
    for i in (0, 2):
        assert entries[i].text == alone(engine, Request(ids[i], max_tokens=24))[0]


def test_the_server_batches_with_the_head_or_without_a_drafter(
    engine: Engine, converted: Path, tmp_path: Path
) -> None:
    """Issue 43: `--no-mtp`, prompt lookup, a draft model and DFlash batch too (plain batched
    steps; each row's own n-grams; each row's own draft caches; each row's own context);
    an engine whose requests cannot batch (`--max-kv-size`) decodes one request at a time,
    and the worker says why in one line. (Changed: prompt lookup, then DFlash, was the
    drafter refused here.)"""
    from mtpkit.serve.worker import Worker
    from mtpkit.speculative.proposers.choose import DrafterChoice
    from tests.checkpoints import build_dense_model
    from tests.dflash_checkpoints import build_dflash

    assert Worker(engine, capacity=1, concurrency=4).batch is not None
    assert Worker(engine, capacity=1, concurrency=1).batch is None  # the single stream
    plain = Engine(engine.m, mtp=False)
    lookup = Engine(engine.m, drafter=DrafterChoice(prompt_lookup=True))
    assert Worker(plain, capacity=1, concurrency=4).batch is not None
    assert Worker(lookup, capacity=1, concurrency=4).batch is not None
    draft = Engine(engine.m, drafter=DrafterChoice(draft_model=converted))
    assert Worker(draft, capacity=1, concurrency=4).batch is not None
    dense = build_dense_model(tmp_path / "llama", "llama", layers=4)
    dflash = build_dflash(tmp_path / "dflash", dense, target_layer_ids=[0, 2])
    blocks = Engine.load(dense, drafter=DrafterChoice(draft_model=dflash), prompt_cache_size=0)
    assert Worker(blocks, capacity=1, concurrency=4).batch is not None
    alone = Worker(Engine(engine.m, max_kv_size=64), capacity=1, concurrency=4)
    assert alone.batch is None
    assert alone.alone_because == (
        "--max-kv-size bounds one stream's caches, not a batch's: requests decode one at a "
        "time (drop --max-kv-size to batch them)"
    )


def test_requests_without_a_drafter_join_and_leave_as_single_streams(engine: Engine) -> None:
    """`--no-mtp`: the rows take plain batched steps; each request, joining late or leaving
    at a stop string, gets what the same request gets alone."""
    plain = Engine(engine.m, mtp=False, prompt_cache_size=0)
    ids = [plain.m.tokenizer.encode(p) for p in PROMPTS]
    full = alone(plain, Request(ids[1], max_tokens=24))[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    requests = [Request(ids[0], max_tokens=24), Request(ids[1], max_tokens=24, stop=(stop,)),
                Request(ids[2], max_tokens=9), Request(ids[3], max_tokens=24)]  # fmt: skip
    batch = BatchSession(plain)
    entries = [batch.add(r) for r in requests[:2]]
    for _ in range(4):
        batch.step()
    entries += [batch.add(r) for r in requests[2:]]
    while batch.entries:
        batch.step()
    for request, entry in zip(requests, entries, strict=True):
        assert (entry.text, entry.finish_reason, entry.generated) == alone(plain, request)
        assert entry.stats.drafted == 0 and entry.stats.proposer == "none"
    assert batch.decoder.plain_steps > 0 and entries[1].finish_reason == "stop"


def test_a_request_without_a_depth_chooses_it_in_a_batch_as_alone(engine: Engine) -> None:
    """Issue 43: `depth` unset means adaptive depth (1-3) at any concurrency, chosen from
    the row's own verdicts; greedy, every row stays its single stream."""
    ids = [engine.m.tokenizer.encode(p) for p in PROMPTS]
    batch = BatchSession(engine, adaptive=False)  # every round drafts: the depths show
    chosen = [batch.add(Request(i, max_tokens=40)) for i in ids[:2]]
    fixed = batch.add(Request(ids[2], max_tokens=40, adaptive=False))
    while batch.entries:
        batch.step()
    for entry in [*chosen, fixed]:
        assert (entry.text, entry.finish_reason, entry.generated) == alone(engine, entry.request)
    # The head's yield here does not pay for a round on the CPU's prior, alone as in a
    # batch: the rows (not the batch, whose adaptive drafting is off) chose plain stretches.
    depths = {len(d) for e in chosen for _, d in e.row.draft_log}
    assert depths == {0, 1} and all(e.row.chooser is not None for e in chosen)
    assert fixed.row.chooser is None and {len(d) for _, d in fixed.row.draft_log} == {1}


def test_a_seeded_row_choosing_its_depth_samples_alike_whatever_joins(engine: Engine) -> None:
    """A seeded sampled request without a depth draws the same text alone and with rows
    joining it mid-decode (a join reads a round built ahead early: its depths must not
    follow when that happens)."""
    from mtpkit.speculative.accept import SamplingSettings

    ids = [engine.m.tokenizer.encode(p) for p in PROMPTS]
    sampled = Request(ids[0], max_tokens=40, sampling=SamplingSettings(temp=1.0), seed=7)

    def decode(joining: list[list[int]]) -> str:
        batch = BatchSession(engine, adaptive=False)
        entry = batch.add(sampled)
        for prompt in joining:
            batch.step()
            batch.add(Request(prompt, max_tokens=40))
        while batch.entries:
            batch.step()
        return entry.text

    assert decode(ids[1:]) == decode([])


def test_without_a_drafter_a_next_turn_joins_from_a_single_streams_cache(
    engine: Engine,
) -> None:
    """A `--no-mtp` conversation: a turn decoded alone leaves its state in the prompt cache;
    the next turn, in a batch, prefills only what it adds and gets its text alone."""
    plain = Engine(engine.m, mtp=False)
    first = Request(plain.m.tokenizer.encode(PROMPTS[0]), max_tokens=12)
    session = plain.session(first)
    list(session)
    assert session.stats.generated  # the cached state holds the answer, not only the prompt
    turn = Request([*first.prompt, *session.stats.generated, *first.prompt[:3]], max_tokens=12)
    batch = BatchSession(plain)
    entry = batch.add(turn)
    batch.add(Request(plain.m.tokenizer.encode(PROMPTS[1]), max_tokens=12))
    while batch.entries:
        batch.step()
    assert entry.stats.cached_tokens == len(first.prompt) + len(session.stats.generated) - 1
    fresh = Engine(engine.m, mtp=False, prompt_cache_size=0)
    assert (entry.text, entry.finish_reason, entry.generated) == alone(fresh, turn)


@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft-model"])
def test_a_batched_turn_leaves_its_drafters_state_for_the_next(
    engine: Engine, converted: Path, drafter: str
) -> None:
    """A conversation by prompt lookup or with a draft model: a turn decoded in a batch
    leaves its row's state (the target's caches and its proposer, taken out of the batch's)
    in the prompt cache; the next turn, alone, prefills only what it adds and gets the text
    and the drafts a fresh engine gives it (every draft kept, for the model drafting for
    itself): the taken proposer held the row's history or draft caches exactly."""
    from mtpkit.speculative.proposers.choose import DrafterChoice

    choice = (DrafterChoice(prompt_lookup=True) if drafter == "prompt-lookup"
              else DrafterChoice(draft_model=converted))  # fmt: skip
    chat = Engine(engine.m, drafter=choice)
    first = Request(chat.m.tokenizer.encode(PROMPTS[0]), max_tokens=12)
    batch = BatchSession(chat)
    entry = batch.add(first)
    batch.add(Request(chat.m.tokenizer.encode(PROMPTS[1]), max_tokens=20))
    while batch.entries:
        batch.step()
    generated = entry.stats.generated
    assert generated and entry.stats.proposer == drafter
    turn = Request([*first.prompt, *generated, *first.prompt[:3]], max_tokens=12, depth=2,
                   adaptive=False)  # fmt: skip
    session = chat.session(turn)
    text = "".join(e.text for e in session)
    assert session.stats.cached_tokens >= len(first.prompt) + len(generated) - 1
    fresh = Engine(engine.m, drafter=choice, prompt_cache_size=0).session(turn)
    assert (text, session.finish_reason) == ("".join(e.text for e in fresh), fresh.finish_reason)
    assert session.stats.draft_log == fresh.stats.draft_log and session.stats.drafted > 0
    if drafter == "draft-model":
        assert session.stats.accepted == session.stats.drafted
