"""A DFlash drafter in a batch (`DFlashRows`), proved row by row against single streams.

On a tiny Qwen3-dense target and a drafter in z-lab's format fitted to one prompt's text
(so that some of its drafts are kept and others rolled back), greedy rows of different
prompt lengths (one past the drafter's context chunk), at different depths, with plain
batched steps between rounds, one joining late and one leaving early, must be stock mlx-lm's
single-stream greedy tokens on the target; and every draft a row proposed in the batch
must be the draft the one-stream proposer proposes alone over the same confirmed tokens
(and the numpy drafter's, `tests.dflash_reference`): each row's context K/V, features
and last token are its own, through every kept count.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.batch import BatchDecoder
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.proposers.dflash import DFlashProposer
from mtpkit.speculative.proposers.dflash_rows import DFlashRows
from tests.checkpoints import build_dense_model
from tests.dflash_checkpoints import build_dflash, fit_dflash
from tests.dflash_reference import ReferenceDFlash, StockTarget
from tests.stock import stock_tokens
from tests.test_batch import Schedule

FITTED = list(range(5, 21))
PROMPTS = [FITTED, list(range(100, 170)), [300, 301, 302], list(range(40, 49))]
DEPTHS = [4, 2, 3, 4]
N = 14


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("dflash-rows")
    target = build_dense_model(tmp / "target", "qwen3", layers=4)
    draft = build_dflash(tmp / "dflash", target, target_layer_ids=[0, 2])
    text = stock_tokens(target, FITTED, 28, eos=False)
    fit_dflash(draft, target, FITTED + text, len(FITTED) - 1, steps=25)
    return target, draft


def alone(m, factory: ProposerFactory, tokens: list[int]) -> DFlashProposer:
    """The one-stream proposer after confirmed `tokens` (the last not yet computed by the
    target), prefilled over them as one stream's is."""
    proposer = factory()
    proposer.begin(tokens, 0)
    _, hidden = m.forward(mx.array(tokens[:-1])[None], m.make_cache())
    proposer.observe(hidden, tokens[1:])
    proposer.end_prefill()
    return proposer


def alone_drafts(m, factory: ProposerFactory, tokens: list[int], depth: int) -> list[int]:
    return alone(m, factory, tokens).propose(depth, SamplingSettings()).drafts.tolist()


def test_rows_are_stock_and_draft_as_they_do_alone(
    pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row stock's; every block's logits the one-stream proposer's over the row's
    confirmed tokens (and its context exactly those tokens but the last), its drafts the
    one-stream proposer's and the numpy drafter's."""
    target, draft = pair
    blocks: list[tuple[int, mx.array]] = []  # each block drafted: (context length, logits)
    block_logits = DFlashProposer.block_logits

    def record(self: DFlashProposer, depth: int) -> mx.array:
        covered = self.stream.covered
        logits = block_logits(self, depth)
        blocks.append((covered, logits))
        return logits

    monkeypatch.setattr(DFlashProposer, "block_logits", record)
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    assert factory().batches
    seen: list[tuple[int, int, list[int]]] = []  # (row, first draft's position, its drafts)
    rows: list = []

    def spy(row, position: mx.array, drafts: mx.array) -> mx.array:
        seen.append((next(i for i, x in enumerate(rows) if x is row), int(position.item()), drafts[: row.depth].tolist()))
        return drafts

    schedule = Schedule([True, True, False])
    decoder = BatchDecoder(m, depth=4, proposers=factory, policy=schedule, draft_filter=spy)
    decoder.eos = set()
    rows.append(decoder.add(PROMPTS[0], max_tokens=N, depth=DEPTHS[0]))
    rows.append(decoder.add(PROMPTS[1], max_tokens=N, depth=DEPTHS[1]))
    rows.append(decoder.add(PROMPTS[2], max_tokens=5, depth=DEPTHS[2]))  # leaves early
    for _ in range(3):
        decoder.step()
    assert isinstance(decoder.proposer, DFlashRows)
    rows.append(decoder.add(PROMPTS[3], max_tokens=N, depth=DEPTHS[3]))  # joins late
    while decoder.rows:
        decoder.step()
    assert rows[2].finish == "length" and decoder.plain_steps > 0
    monkeypatch.setattr(DFlashProposer, "block_logits", block_logits)

    references = [stock_tokens(target, p, N, eos=False) for p in PROMPTS]
    for r, row in enumerate(rows):
        assert row.tokens == references[r][: row.max_tokens], r
    assert sum(row.accepted for row in rows) > 0  # some drafts kept, some rolled back
    assert sum(row.drafted for row in rows) > sum(row.accepted for row in rows)
    assert {r for r, _, _ in seen} == {0, 1, 2, 3}

    stock, ref = StockTarget(target), ReferenceDFlash(draft)
    assert len(blocks) == len(seen)  # every row drafts in every round (in row order)
    for (r, position, drafts), (covered, logits) in zip(seen, blocks, strict=True):
        text = PROMPTS[r] + references[r]
        assert covered == position - 1, (r, position)
        expected = alone(m, factory, text[:position]).block_logits(DEPTHS[r])
        assert mx.allclose(logits, expected, atol=1e-4).item(), (r, position)
        assert drafts == alone_drafts(m, factory, text[:position], DEPTHS[r]), (r, position)
        assert drafts == ref.drafts(text[:position], DEPTHS[r], stock), (r, position)


def test_a_row_taken_out_drafts_as_one_stream(pair: tuple[Path, Path]) -> None:
    """`take`: a row leaving the batch is one stream's proposer over its tokens, drafting
    as a proposer prefilled over them alone."""
    target, draft = pair
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    decoder = BatchDecoder(m, depth=3, proposers=factory)
    decoder.eos = set()
    first = decoder.add(PROMPTS[0], max_tokens=N, depth=3)
    decoder.add(PROMPTS[3], max_tokens=N, depth=2)
    for _ in range(3):
        decoder.step()
    tokens = first.prompt + first.tokens
    taken = decoder.proposer.take(0, tokens)
    assert taken.stream.covered == len(tokens) - 1
    assert taken.propose(3, SamplingSettings()).drafts.tolist() == alone_drafts(
        m, factory, tokens, 3
    )


def test_a_next_turn_joins_from_its_prompt_cache_entry(pair: tuple[Path, Path]) -> None:
    """A row that leaves the batch finished keeps its prompt cache entry (`take`); the next
    turn, extending it, joins from that entry, prefilling only what it adds, and is stock's,
    drafting as the one-stream proposer does over the same tokens."""
    from mtpkit.speculative.prompt_cache import PromptCache

    target, draft = pair
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    seen: list[tuple[int, list[int]]] = []
    turn: list[int] = []  # the next turn's prompt, once known

    def spy(row, position: mx.array, drafts: mx.array) -> mx.array:
        if turn and row.prompt == turn:
            seen.append((int(position.item()), drafts[: row.depth].tolist()))
        return drafts

    cache = PromptCache(4)
    decoder = BatchDecoder(m, depth=3, proposers=factory, prompt_cache=cache, draft_filter=spy)
    decoder.eos = set()
    first = decoder.add(PROMPTS[0], max_tokens=6)
    decoder.add(PROMPTS[3], max_tokens=N)  # still decoding as the first leaves
    while first in decoder.rows:
        decoder.step()
    turn.extend(PROMPTS[0] + first.tokens + [7, 8, 9])
    entry = cache.longest_prefix(turn, decoder.proposer_name)
    assert entry is not None and len(entry.tokens) == len(PROMPTS[0]) + 6
    row = decoder.add(turn, max_tokens=N, cached=entry)
    while decoder.rows:
        decoder.step()
    assert row.stats.cached_tokens == len(entry.tokens) - 1
    reference = stock_tokens(target, turn, N, eos=False)
    assert row.tokens == reference and seen
    for position, drafts in seen:
        text = turn + reference
        assert drafts == alone_drafts(m, factory, text[:position], 3), position


def test_a_seeded_sampled_row_draws_alike_alone_and_in_a_batch(pair: tuple[Path, Path]) -> None:
    """A sampled row with a seed draws each block position's draft and its verdicts from its
    own keys: the same tokens as the only row and beside greedy and sampled rows."""
    target, draft = pair
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    sampled = SamplingSettings(temp=1.0, top_k=3)

    def run(others: list[list[int]]) -> tuple[list[int], int]:
        decoder = BatchDecoder(m, depth=3, proposers=factory)
        decoder.eos = set()
        rows = [
            decoder.add(p, max_tokens=N, sampling=sampled if i else SamplingSettings())
            for i, p in enumerate(others)
        ]
        row = decoder.add(FITTED, max_tokens=N, sampling=sampled, seed=11)
        while decoder.rows:
            decoder.step()
        assert all(r.tokens for r in rows)
        return row.tokens, row.drafted

    alone, drafted = run([])
    assert len(alone) == N and drafted > 0
    assert run([PROMPTS[1], PROMPTS[3]])[0] == alone


def test_the_servers_batch_takes_dflash_requests_as_they_are_alone(
    pair: tuple[Path, Path],
) -> None:
    """`serve --decode-concurrency`'s `BatchSession` over a DFlash engine: requests joining
    between steps each get the text, finish and token count the same request gets alone
    (`Engine.session`), and report the dflash drafter's drafts."""
    from mtpkit.speculative.batch.session import BatchSession
    from mtpkit.speculative.session import Engine, Request

    target, draft = pair
    engine = Engine.load(target, drafter=DrafterChoice(draft_model=draft), prompt_cache_size=0)
    requests = [Request(PROMPTS[0], max_tokens=12), Request(PROMPTS[1], max_tokens=7),
                Request(PROMPTS[3], max_tokens=12)]  # fmt: skip

    def alone(request: Request) -> tuple[str, str | None, int]:
        session = engine.session(request)
        tokens = sum(e.token is not None for e in session)
        return session.text, session.finish_reason, tokens

    expected = [alone(r) for r in requests]
    batch = BatchSession(engine)
    entries = [batch.add(r) for r in requests[:2]]
    for _ in range(2):
        batch.step()
    assert isinstance(batch.decoder.proposer, DFlashRows)
    entries.append(batch.add(requests[2]))
    while batch.entries:
        batch.step()
    for entry, want in zip(entries, expected, strict=True):
        assert (entry.text, entry.finish_reason, entry.generated) == want
        assert entry.stats.proposer == "dflash"
    assert sum(e.stats.drafted for e in entries) > 0
