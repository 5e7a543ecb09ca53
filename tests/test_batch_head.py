"""The head's drafts in a batch are the head's own predictions over each row's sequence.

On the bundled example (a trained head), rows decode together at depth 1 with plain batched
steps between rounds and a row joining during a stretch of plain steps. Afterwards each
row's whole sequence is run through the backbone and the head in one pass each (no caches):
every draft a row verified must be the head's argmax at that position, so the head's cache
(rolled back per row, caught up after plain steps, merged at joins) held exactly each row's
confirmed pairs and nothing of another row's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder, Row
from tests.test_batch import Schedule

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
TEXTS = ["Return the number of", "Create a new", "Open the file named", "Read"]


@pytest.fixture(scope="module")
def m():
    return load_model(EXAMPLE)


def head_predictions(m, row: Row) -> list[int]:
    """predicted[k]: the head's guess for the token at k + 2 of prompt + output."""
    sequence = row.prompt + row.tokens
    m.model(mx.array(sequence)[None])
    hidden = m.hidden_state()
    x = m.head(hidden[:, :-1], m.embed(mx.array(sequence[1:])[None]))
    return mx.argmax(m.lm_head(m.head.final_norm(0)(x)), axis=-1)[0].tolist()


@pytest.mark.parametrize(
    ("catch_up_after", "plain_run"),
    [(256, 2), (2, 2), (256, 7)],
    ids=["at-draft", "every-2-steps", "7-pairs-in-chunks"],
)
def test_each_rows_drafts_are_the_heads_predictions(
    m, monkeypatch: pytest.MonkeyPatch, catch_up_after: int, plain_run: int
) -> None:
    """Also with the head catching up inside a stretch of plain steps (every 2 pairs), and
    on 7 pending pairs at a draft (chunks of 4, 2 and 1: `power_chunks`)."""
    from mtpkit.speculative.proposers import mtp_head as head

    monkeypatch.setattr(head, "ROWS_CATCH_UP_AFTER", catch_up_after)
    counts, chunks = [], head.power_chunks
    monkeypatch.setattr(head, "power_chunks", lambda n: counts.append(n) or chunks(n))
    pattern = [True, True] + [False] * plain_run + [True]
    decoder = BatchDecoder(m, depth=1, policy=Schedule(pattern))
    decoder.eos = set()
    prompts = [m.tokenizer.encode(t) for t in TEXTS]
    rows = [decoder.add(prompts[0], max_tokens=40), decoder.add(prompts[1], max_tokens=20)]
    for _ in range(3):
        decoder.step()  # two rounds, then a plain step: the joins find pairs pending
    rows += [decoder.add(p, max_tokens=40) for p in prompts[2:]]
    while decoder.rows:
        decoder.step()
    assert decoder.plain_steps > 5
    assert max(counts) == min(plain_run, catch_up_after)  # the catch-ups ran
    for row in rows:
        predicted = head_predictions(m, row)
        sequence = row.prompt + row.tokens
        assert row.rounds > 3
        for position, drafts in row.draft_log:
            assert drafts == [predicted[position - 2]], (row.uid, position)
        kept = sum(1 for p, d in row.draft_log if p < len(sequence) and d[0] == sequence[p])
        assert row.accepted == kept
    assert sum(row.accepted for row in rows) > 10


def round_of_fresh_tokens(m, prompt: list[int]) -> tuple[Row, int]:
    """The prompt decoded alone at depth 2 (no EOS), and where in its output a round starts
    that kept both drafts and whose three tokens are new to the output: EOS candidates that
    end the row inside that round (the example's text soon repeats)."""
    probe = BatchDecoder(m, depth=2)
    probe.eos = set()
    row = probe.add(prompt, max_tokens=40)
    while probe.rows:
        probe.step()
    rounds = [(p - len(prompt), d) for p, d in row.draft_log]
    start = next(
        i for i, d in rounds
        if row.tokens[i : i + 2] == d and len(set(row.tokens[i : i + 3])) == 3
        and not set(row.tokens[i : i + 3]) & set(row.tokens[:i])
    )  # fmt: skip
    return row, start


@contextlib.contextmanager
def eos_inside_a_round(m, prompt: list[int], at: int) -> Iterator[tuple[list[int], int, int]]:
    """Within the block, the tokenizer's only EOS is the `at`-th token a depth-2 round of
    `prompt`'s decoding confirms (`round_of_fresh_tokens`); yields (that decoding's tokens
    with no EOS, where the round starts, the EOS)."""
    row, start = round_of_fresh_tokens(m, prompt)
    eos = row.tokens[start + at]
    saved = m.tokenizer.eos_token_ids
    m.tokenizer.eos_token_ids = {eos}
    try:
        yield row.tokens, start, eos
    finally:
        m.tokenizer.eos_token_ids = saved


@pytest.mark.parametrize("at", [0, 1, 2], ids=["first-draft", "second-draft", "bonus"])
def test_a_row_ending_at_an_eos_counts_its_drafts_as_one_stream_does(m, at: int) -> None:
    """A row whose EOS comes inside a round (as its first or second kept draft, or as the
    round's own token) counts drafted and accepted as one stream's decoder does (drafts past
    the EOS count for nothing): the single stream (`MtpDecoder`, another code path) is the
    reference for that round, the EOS chosen from the tokens a depth-2 round confirms."""
    from mtpkit.speculative.decode import MtpDecoder, SamplingSettings

    prompt = m.tokenizer.encode(TEXTS[0])
    with eos_inside_a_round(m, prompt, at) as (fresh, start, _):
        batch = BatchDecoder(m, depth=2)
        batched = batch.add(prompt, max_tokens=40)
        while batch.rows:
            batch.step()
        single = MtpDecoder(m, prompt, depth=2, sampling=SamplingSettings(), adaptive=False)
        alone = list(single.tokens(40))
    assert batched.tokens == alone == fresh[: start + at]
    # The round the EOS ended keeps the same drafts counted in both decoders (their first
    # rounds differ by design, so their totals are not compared) ...
    assert batched.draft_log[-1] == single.stats.draft_log[-1]
    assert len(batched.draft_log[-1][1]) == min(at, 2)
    # ... and the row's counts are its log's: every draft left in it, each kept while the
    # output agrees with it.
    sequence = prompt + batched.tokens
    kept = 0
    for position, drafts in batched.draft_log:
        for j, draft in enumerate(drafts):
            if position + j >= len(sequence) or sequence[position + j] != draft:
                break
            kept += 1
    assert batched.drafted == sum(len(d) for _, d in batched.draft_log)
    assert batched.accepted == kept


@pytest.mark.parametrize("at", [1, 2], ids=["after-first-draft", "after-second-draft"])
def test_a_row_ending_at_max_tokens_counts_no_draft_past_its_end(m, at: int) -> None:
    """A row whose `max_tokens` falls inside a round that kept both drafts counts only the
    drafts inside its output, as one stream does (which drafts no further than its room):
    its accepted drafts never outnumber its tokens after the first (the server's
    `speculative_decoding` fields and metrics read these counts)."""
    prompt = m.tokenizer.encode(TEXTS[0])
    probe, start = round_of_fresh_tokens(m, prompt)
    limit = start + at
    batch = BatchDecoder(m, depth=2)
    batch.eos = set()
    row = batch.add(prompt, max_tokens=limit)
    while batch.rows:
        batch.step()
    assert row.tokens == probe.tokens[:limit] and row.finish == "length"
    position, drafts = row.draft_log[-1]
    assert position + len(drafts) <= len(prompt) + limit  # no draft past the last token
    sequence = prompt + row.tokens
    kept = sum(
        1 for p, d in row.draft_log for j, t in enumerate(d)
        if p + j < len(sequence) and sequence[p + j] == t
    )  # fmt: skip
    assert row.accepted == kept <= len(row.tokens) - 1
