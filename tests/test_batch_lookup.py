"""Prompt lookup in a batch (`LookupRows`), proved row by row against single streams of stock
mlx-lm.

Each row looks up its own prompt and output: rows of different prompt lengths find drafts of
different lengths (some none, a plain step inside the round), keep different counts and roll
back on their own. On one fixture layout per kind of cache (from the registry, as
`test_batch_plain` picks them), every greedy row must be its prompt's tokens alone with stock
`mlx_lm.stream_generate` on a fresh load, with a row joining late, one leaving early at its
max_tokens and one removed mid-way; the engine's factory makes each row's proposer, as a
server's rows get theirs.
"""

from __future__ import annotations

from pathlib import Path

from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder
from mtpkit.speculative.batch.session import BatchSession
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.proposers.prompt_lookup import LookupRows
from mtpkit.speculative.session import Engine, Request
from tests.checkpoints import CheckpointFactory
from tests.test_batch_plain import one_layout_per_cache_kind, stock_greedy

# Prompts that hold many of the fixtures' 512 ids, so that one-token lookups
# (`--prompt-lookup-min 1`) find drafts in most rounds (right when the model repeats what
# followed in the prompt, else wrong); of different lengths, one too short to find much.
PROMPTS = [
    list(range(0, 512, 3)),
    [300, 301, 302, 300, 301],
    list(range(1, 512, 4)) + list(range(60, 66)),
    [7, 9, 11],
]
N = 12


def decode_joining_and_leaving(path: Path) -> tuple[list[list[int]], int, int]:
    """Rows of `PROMPTS` drafting by prompt lookup: rows 0 and 1 first (row 1 ends early, at
    5 tokens), row 2 joins after two steps, row 3 is removed after one more. Returns their
    tokens, the drafts verified and kept in all."""
    m = load_model(path, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(prompt_lookup=True, prompt_lookup_min=1))
    decoder = BatchDecoder(m, depth=3, proposers=factory)
    decoder.eos = set()
    first = decoder.add(PROMPTS[0], max_tokens=N)
    short = decoder.add(PROMPTS[1], max_tokens=5)
    decoder.step()
    assert isinstance(decoder.proposer, LookupRows)
    decoder.step()
    late = decoder.add(PROMPTS[2], max_tokens=N)
    removed = decoder.add(PROMPTS[3], max_tokens=N)
    decoder.step()
    decoder.remove(removed)
    while decoder.rows:
        decoder.step()
    assert short.finish == "length" and removed.finish == "cancelled"
    assert decoder.rounds_ahead == 0  # host drafts: every round is read before the next
    rows = [first, short, late, removed]
    drafted = sum(r.drafted for r in rows)
    return [r.tokens for r in rows], drafted, sum(r.accepted for r in rows)


def test_every_cache_kind_batches_by_prompt_lookup_as_stock(checkpoint: CheckpointFactory) -> None:
    chosen = one_layout_per_cache_kind(checkpoint)
    drafted = accepted = 0
    for key, path in chosen.items():
        references = stock_greedy(path, PROMPTS, N)
        (first, short, late, removed), d, a = decode_joining_and_leaving(path)
        assert first == references[0] and late == references[2], key
        assert short == references[1][:5], key
        assert 0 < len(removed) < N and removed == references[3][: len(removed)], key
        assert d > 0, key  # every layout verified drafts
        drafted, accepted = drafted + d, accepted + a
    assert 0 < accepted < drafted  # some drafts kept, some rolled back


def test_a_lookup_session_batches_each_request_as_it_decodes_alone(converted: Path) -> None:
    """On the bundled example: `BatchSession` over a prompt-lookup engine, requests joining
    between rounds; each text is the one the same request gets alone (`Session`)."""
    engine = Engine.load(
        converted, drafter=DrafterChoice(prompt_lookup=True), prompt_cache_size=0
    )
    texts = ["def main(argv):\n    main(argv)\n    main(", "for i in range(10):", "x = x + x +"]
    ids = [engine.m.tokenizer.encode(t) for t in texts]
    batch = BatchSession(engine)
    entries = [batch.add(Request(ids[0], max_tokens=24)), batch.add(Request(ids[1], max_tokens=9))]
    batch.step()
    entries.append(batch.add(Request(ids[2], max_tokens=24)))
    while batch.entries:
        batch.step()
    assert sum(e.stats.drafted for e in entries) > 0
    for entry in entries:
        assert entry.stats.proposer == "prompt-lookup"
        session = engine.session(entry.request)
        for _ in session:
            pass
        assert (entry.text, entry.finish_reason) == (session.text, session.finish_reason)


def test_a_seeded_sampled_row_draws_alike_alone_and_in_a_batch(converted: Path) -> None:
    """A sampled row with a seed draws its verdicts from its own key and looks up its own
    history: the same tokens alone and beside other rows."""
    from mtpkit.speculative.accept import SamplingSettings

    m = load_model(converted, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(prompt_lookup=True, prompt_lookup_min=1))
    prompt = m.tokenizer.encode("def f(x):\n    return f(x) + f(x) + f(")

    def run(others: list[list[int]]) -> tuple[list[int], int]:
        decoder = BatchDecoder(m, depth=3, proposers=factory)
        rows = [decoder.add(p, max_tokens=16) for p in others]
        row = decoder.add(prompt, max_tokens=16, sampling=SamplingSettings(temp=0.7), seed=3)
        while decoder.rows:
            decoder.step()
        assert all(r.tokens for r in rows)
        return row.tokens, row.drafted

    alone, drafted = run([])
    assert len(alone) > 4 and drafted > 0
    assert run([list(range(40, 24, -1)), [300, 301, 300]])[0] == alone
