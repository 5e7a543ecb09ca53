"""An EAGLE-3 drafter in a batch (`Eagle3Rows`), proved row by row against stock mlx-lm and
against each row decoding alone.

Each row keeps its own drafter KV cache (merged as the target's are, left-padded) and its own
pending pairs, and rolls back to its own kept prefix. On the drafter's test checkpoints
(`tests/eagle3_checkpoints.py`; random weights: drafts that follow every change of context),
every greedy row must be its prompt's tokens alone with stock `mlx_lm.stream_generate`, with
rows of different prompt lengths at different depths, plain steps between rounds, a row
joining late, one leaving early at its max_tokens and one removed mid-way; first as the
drafter drafts (every draft rejected), then with drafts injected right up to a planned count
per row and round (every partial acceptance, different in each row of a round). Every round's
drafts of every row must be the numpy drafter's over that row's confirmed tokens
(`tests/eagle3_reference.py`), and, where the row decoding alone drafts at the same position,
that one-stream proposer's drafts: a cache, a position or a pending pair kept wrong for any
row would draft otherwise.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder
from mtpkit.speculative.proposers.base import RowsProposal
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.proposers.eagle3_rows import Eagle3Rows
from tests.checkpoints import build_dense_model
from tests.eagle3_checkpoints import build_eagle3
from tests.eagle3_reference import ReferenceEagle3, StockInputs
from tests.test_batch import Schedule
from tests.test_batch_plain import stock_greedy
from tests.test_dflash import spy_drafts
from tests.test_eagle3 import PROMPT, decoder_for

PROMPTS = [PROMPT, [300, 301, 302], list(range(40, 64)), [7]]
DEPTHS = [3, 1, 2, 1]
N = 14
VOCAB = 512  # the fixture target's


@pytest.fixture(scope="module")
def fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    """A Llama target, a drafter whose draft vocabulary holds every prompt and its greedy
    text (and more), and those texts (stock mlx-lm's)."""
    tmp = tmp_path_factory.mktemp("eagle3rows")
    target = build_dense_model(tmp / "target", "llama", layers=8)
    references = stock_greedy(target, PROMPTS, N)
    vocab = set(range(100, 160)).union(*(p + t for p, t in zip(PROMPTS, references, strict=True)))
    draft = build_eagle3(tmp / "eagle3", target, vocab_ids=sorted(vocab))
    return target, draft, references


def decode_joining_and_leaving(target: Path, draft: Path, inject=None) -> list:
    """Rows of `PROMPTS` at `DEPTHS`: rows 0 and 1 first (row 1 ends early, at 5 tokens), a
    round and two plain steps each cycle, row 2 joins after three steps, row 3 joins then and
    is removed after one more step. `inject(decoder, proposal)`: the drafts each round
    verifies instead. Returns the rows."""
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    decoder = BatchDecoder(m, depth=3, proposers=factory, policy=Schedule([True, False, False]))
    decoder.eos = set()
    if inject is not None:
        decoder.proposers = lambda: injecting(factory(), decoder, inject)
    first = decoder.add(PROMPTS[0], max_tokens=N, depth=DEPTHS[0])
    short = decoder.add(PROMPTS[1], max_tokens=5, depth=DEPTHS[1])
    for _ in range(3):
        decoder.step()
    assert isinstance(decoder.proposer, Eagle3Rows)
    late = decoder.add(PROMPTS[2], max_tokens=N, depth=DEPTHS[2])
    removed = decoder.add(PROMPTS[3], max_tokens=N, depth=DEPTHS[3])
    decoder.step()
    decoder.remove(removed)
    while decoder.rows:
        decoder.step()
    assert short.finish == "length" and removed.finish == "cancelled"
    assert decoder.plain_steps > 0
    return [first, short, late, removed]


def injecting(proposer, decoder: BatchDecoder, inject):
    """`proposer`, whose batch's drafter verifies `inject`'s drafts instead of its own."""
    batched = proposer.batched

    def rows() -> Eagle3Rows:
        drafter = batched()
        own = drafter.propose
        drafter.propose = lambda *args: inject(decoder, own(*args))
        return drafter

    proposer.batched = rows
    return proposer


def check_rows(rows: list, references: list[list[int]]) -> None:
    """Each row's tokens are its prompt's alone with stock mlx-lm (up to where it left)."""
    first, short, late, removed = (r.tokens for r in rows)
    assert first == references[0] and late == references[2]
    assert short == references[1][:5]
    assert 0 < len(removed) < N and removed == references[3][: len(removed)]
    assert all(any(d for _, d in r.stats.draft_log) for r in rows)


def test_rows_are_stock_and_draft_as_alone(fixture) -> None:
    """The drafter's own drafts: each row's are the numpy drafter's over its confirmed
    tokens, and its one-stream proposer's wherever that drafts at the same position."""
    target, draft, references = fixture
    rows = decode_joining_and_leaving(target, draft)
    check_rows(rows, references)
    ref = ReferenceEagle3(draft, StockInputs(target))
    shared = 0
    for r, row in enumerate(rows):
        text = PROMPTS[r] + references[r]
        logged = [(p, d) for p, d in row.stats.draft_log if d]
        for position, drafts in logged:
            assert drafts == ref.drafts(text[:position], len(drafts)), (r, position)
        alone = decoder_for(target, draft, DEPTHS[r], prompt=PROMPTS[r])
        seen = spy_drafts(alone)
        list(alone.tokens(len(row.tokens)))
        by_position = dict(seen)
        for position, drafts in logged:
            if position in by_position:
                shared += 1
                assert drafts == by_position[position][: len(drafts)], (r, position)
    assert shared >= len(rows)
    assert len({tuple(d) for row in rows for _, d in row.stats.draft_log}) > 4  # not constant


def test_partial_acceptances_roll_each_row_back_on_its_own(fixture) -> None:
    """Drafts injected right up to a planned count per row and round (0 to its depth, in a
    cycle shifted per row): exactly those are kept, the text is stock's, and after every
    partial acceptance each row's own chain is still the numpy drafter's."""
    target, draft, references = fixture
    own: list[tuple[int, int, list[int]]] = []  # (prompt index, position, drafts)
    planned: dict[int, int] = {}  # kept planned per prompt index

    def inject(decoder: BatchDecoder, proposal: RowsProposal) -> RowsProposal:
        injected = []
        for row, drafts in zip(decoder.rows, proposal.drafts.tolist(), strict=True):
            r = PROMPTS.index(row.prompt)
            start = row.position - len(row.prompt)
            own.append((r, row.position, drafts))
            rounds = sum(1 for o in own if o[0] == r)
            right = (rounds + r) % (DEPTHS[r] + 1)
            planned[r] = planned.get(r, 0) + right
            truth = (references[r] + [0] * 8)[start : start + proposal.depth]
            injected.append([t if j < right else (t + 1) % VOCAB for j, t in enumerate(truth)])
        return RowsProposal(mx.array(injected, dtype=mx.int32), proposal.depths, proposal.dists)

    rows = decode_joining_and_leaving(target, draft, inject)
    check_rows(rows, references)
    assert [row.accepted for row in rows] == [planned[r] for r in range(len(rows))]
    assert all(row.accepted > 0 for row in rows[:3])
    ref = ReferenceEagle3(draft, StockInputs(target))
    for r, position, drafts in own:
        text = PROMPTS[r] + references[r]
        assert drafts == ref.drafts(text[:position], len(drafts)), (r, position)


def test_a_batched_turn_leaves_its_drafters_state_for_the_next(fixture) -> None:
    """A turn decoded in a batch leaves its row's drafter (`take`: its cache and pending
    pairs, out of the batch's) in the prompt cache; the next turn, alone, prefills only what
    it adds and gets the tokens and every round's drafts a fresh engine gives it."""
    from mtpkit.speculative.batch import BatchSession
    from mtpkit.speculative.session import Engine, Request

    target, draft, _ = fixture
    m = load_model(target, with_head=False)
    m.tokenizer.eos_token_ids = []
    choice = DrafterChoice(draft_model=draft)
    chat = Engine(m, drafter=choice)
    batch = BatchSession(chat, adaptive=False)
    entry = batch.add(Request(PROMPTS[2], max_tokens=9, depth=2))
    batch.add(Request(PROMPTS[1], max_tokens=13, depth=1))
    while batch.entries:
        batch.step()
    generated = entry.stats.generated
    assert len(generated) == 9 and entry.stats.proposer == "eagle3"
    turn = Request([*PROMPTS[2], *generated, 300, 301], max_tokens=10, depth=3, adaptive=False)
    session = chat.session(turn)
    tokens = [e.token for e in session if e.token is not None]
    assert session.stats.cached_tokens >= len(PROMPTS[2]) + len(generated) - 1
    fresh = Engine(m, drafter=choice, prompt_cache_size=0).session(turn)
    assert tokens == [e.token for e in fresh if e.token is not None]
    assert session.stats.draft_log == fresh.stats.draft_log and session.stats.drafted > 0


def test_a_seeded_sampled_row_draws_alike_alone_and_in_a_batch(fixture) -> None:
    """A sampled row with a seed draws its drafts (over the draft vocabulary, mapped through
    d2t) and its verdicts from its own key: the same tokens alone and beside other rows."""
    from mtpkit.speculative.accept import SamplingSettings

    target, draft, _ = fixture
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))

    def run(others: list[list[int]]) -> tuple[list[int], int]:
        decoder = BatchDecoder(m, depth=2, proposers=factory)
        decoder.eos = set()
        rows = [decoder.add(p, max_tokens=12) for p in others]
        row = decoder.add(PROMPT, max_tokens=12, sampling=SamplingSettings(temp=1.0), seed=11)
        while decoder.rows:
            decoder.step()
        assert all(r.tokens for r in rows)
        return row.tokens, row.drafted

    alone, drafted = run([])
    assert len(alone) == 12 and drafted > 0
    assert run([PROMPTS[2], PROMPTS[1]])[0] == alone
