"""A draft model in a batch (`DraftRows`), proved row by row against single streams of stock
mlx-lm.

Each row keeps its own draft-model caches (merged as the target's are) and rolls them back to
its own kept prefix. On one fixture layout per kind of cache (from the registry, as
`test_batch_plain` picks them), drafting with the same layout's other weights (hybrid draft
models among them: their recurrent states taken per row from each step of the chain) and
with the target itself as its own draft model, every greedy row must be its
prompt's tokens alone with stock `mlx_lm.stream_generate`, with a row joining late after
plain steps, one leaving early at its max_tokens and one removed mid-way. With the target
as its own draft model every draft must be kept: rows at different depths keep different
counts of one round's chain, so a draft cache rolled back wrong for any row would draft a
token the target does not take. A sliding-window draft model's rows, after drafts injected
right then wrong, must each draft the target's own greedy tokens in every later round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.proposers.draft_model_rows import DraftRows
from tests.checkpoints import RAW_LAYOUTS, CheckpointFactory, dtype_for
from tests.test_batch import Schedule
from tests.test_batch_plain import cache_kinds, stock_greedy

PROMPTS = [list(range(60, 90)), [300, 301, 302], list(range(5, 21)), [7]]
N = 10


def decode_joining_and_leaving(
    path: Path, draft: Path, draft_filter: Any = None
) -> tuple[list[list[int]], int, int]:
    """Rows of `PROMPTS` drafting with `draft`, at depths 3, 1, 2 and 1 (a round chains 3
    drafts; a shallower row keeps fewer of them whatever it accepts): rows 0 and 1 first (row
    1 ends early, at 4 tokens), a round, two plain steps, row 2 joins, row 3 joins and is
    removed after one more step (`draft_filter`: the drafts each round verifies instead).
    Returns their tokens, the drafts verified and kept in all."""
    m = load_model(path, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    decoder = BatchDecoder(m, depth=3, proposers=factory, policy=Schedule([True, False, False]),
                           draft_filter=draft_filter)  # fmt: skip
    decoder.eos = set()
    first = decoder.add(PROMPTS[0], max_tokens=N, depth=3)
    short = decoder.add(PROMPTS[1], max_tokens=4, depth=1)
    for _ in range(3):
        decoder.step()
    assert isinstance(decoder.proposer, DraftRows)
    late = decoder.add(PROMPTS[2], max_tokens=N, depth=2)
    removed = decoder.add(PROMPTS[3], max_tokens=N, depth=1)
    decoder.step()
    decoder.remove(removed)
    while decoder.rows:
        decoder.step()
    assert short.finish == "length" and removed.finish == "cancelled"
    assert decoder.plain_steps > 0
    rows = [first, short, late, removed]
    return [r.tokens for r in rows], sum(r.drafted for r in rows), sum(r.accepted for r in rows)


def test_every_cache_kind_batches_with_a_draft_model_as_stock(
    checkpoint: CheckpointFactory,
) -> None:
    """Per cache kind: the same layout with other weights drafting (some drafts kept, most
    rolled back; hybrid, Mamba and sliding-window draft models among them: a window's
    chain overwrites its oldest entries, so its round is put back and fed again), then the
    target drafting for itself (every draft kept)."""
    seen: set[tuple[str, ...]] = set()
    for layout in RAW_LAYOUTS:
        path = checkpoint(layout, dtype=dtype_for(layout), with_mtp=False)
        kinds = cache_kinds(load_model(path, with_head=False))
        if kinds in seen:
            continue
        seen.add(kinds)
        other = checkpoint(layout, dtype=dtype_for(layout), with_mtp=False, seed=1)
        m = load_model(path, with_head=False)
        assert ProposerFactory(m, DrafterChoice(draft_model=other))().batches, kinds
        references = stock_greedy(path, PROMPTS, N)
        for draft in (other, path):
            (first, short, late, removed), drafted, accepted = decode_joining_and_leaving(
                path, draft
            )
            assert first == references[0] and late == references[2], (kinds, draft.name)
            assert short == references[1][:4], (kinds, draft.name)
            assert 0 < len(removed) < N and removed == references[3][: len(removed)], kinds
            assert drafted > 0
            if draft == path:  # the target drafting for itself: every draft kept, which
                # holds only if each row's draft caches kept exactly its confirmed tokens
                assert accepted == drafted, kinds
    kinds = {k for key in seen for k in key}
    assert {"ArraysCache", "KVCache", "CacheList", "MLA", "RotatingKVCache"} <= kinds


def test_a_seeded_sampled_row_draws_alike_alone_and_in_a_batch(converted: Path) -> None:
    """A sampled row with a seed draws its drafts and verdicts from its own key: the same
    tokens alone and beside other rows (the bundled example drafting for itself, so drafts
    are kept and rejected by rejection sampling)."""
    from mtpkit.speculative.accept import SamplingSettings

    m = load_model(converted, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=converted))
    prompt = m.tokenizer.encode("Create a new event loop. You")
    sampled = SamplingSettings(temp=1.0)

    def run(others: list[list[int]]) -> tuple[list[int], int]:
        decoder = BatchDecoder(m, depth=2, proposers=factory)
        rows = [decoder.add(p, max_tokens=16) for p in others]
        row = decoder.add(prompt, max_tokens=16, sampling=sampled, seed=11)
        while decoder.rows:
            decoder.step()
        assert all(r.tokens for r in rows)
        return row.tokens, row.drafted

    alone, drafted = run([])
    assert len(alone) > 4 and drafted > 0
    assert run([list(range(40, 24, -1)), [300, 301]])[0] == alone


def test_a_window_rolls_each_row_back_exactly(checkpoint: CheckpointFactory) -> None:
    """A sliding-window layout (window 8, from the registry) drafting for itself, with drafts
    injected right up to a count planned per row and round (0 to its depth, in a cycle
    shifted per row) and wrong after: rows keep different counts of a chain that overwrote
    the oldest entries of their full windows. Every round's own drafts must then be the
    target's greedy tokens there (stock mlx-lm's), which holds only if each row's window
    holds exactly its confirmed tokens, and every text is stock's."""

    def build(layout: str) -> Path:
        return checkpoint(layout, dtype=dtype_for(layout), with_mtp=False)

    windowed = (lay for lay in RAW_LAYOUTS
                if "RotatingKVCache" in cache_kinds(load_model(build(lay), with_head=False)))  # fmt: skip
    path = build(next(windowed))
    references = stock_greedy(path, PROMPTS, N)
    own: list[tuple[int, int, list[int]]] = []  # (prompt index, offset in output, drafts)

    def inject(row: Any, position: mx.array, drafts: mx.array) -> mx.array:
        r = PROMPTS.index(row.prompt)
        start = int(position.item()) - len(row.prompt)
        own.append((r, start, drafts[: row.depth].tolist()))
        right = (sum(1 for o in own if o[0] == r) + r) % (row.depth + 1)
        truth = (references[r] + [0] * 8)[start : start + drafts.shape[0]]
        wrong = [t if j < right else (t + 1) % 512 for j, t in enumerate(truth)]
        return mx.array(wrong, dtype=mx.int32)

    (first, short, late, removed), drafted, accepted = decode_joining_and_leaving(
        path, path, inject
    )
    assert first == references[0] and late == references[2]
    assert short == references[1][:4]
    assert 0 < len(removed) < N and removed == references[3][: len(removed)]
    assert 0 < accepted < drafted  # partial acceptances
    checked = 0
    for r, start, drafts in own:
        truth = references[r][start : start + len(drafts)]
        assert drafts[: len(truth)] == truth, (r, start)
        checked += len(truth)
    assert checked > 10
