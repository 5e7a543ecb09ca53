"""The head's drafts in a batch are the head's own predictions over each row's sequence.

On the bundled example (a trained head), rows decode together at depth 1 with plain batched
steps between rounds and a row joining during a stretch of plain steps. Afterwards each
row's whole sequence is run through the backbone and the head in one pass each (no caches):
every draft a row verified must be the head's argmax at that position, so the head's cache
(rolled back per row, caught up after plain steps, merged at joins) held exactly each row's
confirmed pairs and nothing of another row's.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("catch_up_after", [256, 2], ids=["at-draft", "every-2-steps"])
def test_each_rows_drafts_are_the_heads_predictions(
    m, monkeypatch: pytest.MonkeyPatch, catch_up_after: int
) -> None:
    """Also with the head catching up inside a stretch of plain steps (every 2 pairs)."""
    from mtpkit.speculative.batch import head

    monkeypatch.setattr(head, "CATCH_UP_AFTER", catch_up_after)
    decoder = BatchDecoder(m, depth=1, policy=Schedule([True, True, False, False, True]))
    decoder.eos = set()
    prompts = [m.tokenizer.encode(t) for t in TEXTS]
    rows = [decoder.add(prompts[0], max_tokens=40), decoder.add(prompts[1], max_tokens=20)]
    for _ in range(3):
        decoder.step()  # two rounds, then a plain step: the joins find pairs pending
    rows += [decoder.add(p, max_tokens=40) for p in prompts[2:]]
    while decoder.rows:
        decoder.step()
    assert decoder.plain_steps > 5
    for row in rows:
        predicted = head_predictions(m, row)
        sequence = row.prompt + row.tokens
        assert row.rounds > 3
        for position, drafts in row.draft_log:
            assert drafts == [predicted[position - 2]], (row.uid, position)
        kept = sum(1 for p, d in row.draft_log if p < len(sequence) and d[0] == sequence[p])
        assert row.accepted == kept
    assert sum(row.accepted for row in rows) > 10
