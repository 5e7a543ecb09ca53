"""Batched MTP decoding, proved row by row against single streams of stock mlx-lm.

Every row's greedy tokens must be the tokens its prompt gives alone with stock
`mlx_lm.stream_generate` (a fresh load, nothing of mtpkit's): with rows of equal and of
different prompt lengths, with drafts injected right up to a depth that differs per row and
per round (so rows roll back different counts in the same round, across round boundaries:
KV caches per row, gated-delta-net states per row, the head's own cache per row), and with
rows joining late and leaving early. A row that saw another row's token, cache entry or
state anywhere would drift from its single-stream reference.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.convert.pipeline import convert
from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder, Row
from tests.checkpoints import build_checkpoint, dtype_for

# mimo: attention only; qwen3_5: gated-delta-net and full-attention layers.
LAYOUTS = ["mimo", "qwen3_5"]
# Every cache kind: MLA (deepseek_v3, glm4_moe_lite), gated delta nets (qwen3_next), sliding
# windows (exaone_moe, mimo_v2_flash, step3p5: window 8), Mamba (nemotron_h), lightning and
# Kimi delta attention (bailing_hybrid, bailing_moe_v3: replayed), cache lists (deepseek_v32).
FAMILIES = [*LAYOUTS, "deepseek_v3", "glm4_moe_lite", "qwen3_next", "exaone_moe", "mimo_v2_flash",
            "step3p5", "nemotron_h", "bailing_hybrid", "bailing_moe_v3", "deepseek_v32"]  # fmt: skip
# Caches the host rolls back with the counts it read (sliding windows cut, recurrent layers
# replayed): their rounds are read before the next is built. Every other family's next round
# is built on the device's rollback before a round is read (`speculative/batch/rounds.py`).
READ_FIRST = {"exaone_moe", "mimo_v2_flash", "step3p5", "nemotron_h", "bailing_hybrid",
              "bailing_moe_v3"}  # fmt: skip
EQUAL = [list(range(5, 21)), list(range(30, 46)), list(range(40, 24, -1))]
UNEQUAL = [list(range(5, 21)), [300, 301, 302], list(range(60, 90)), [7]]


@pytest.fixture(scope="module", params=LAYOUTS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    layout = request.param
    tmp = tmp_path_factory.mktemp(layout)
    src = build_checkpoint(layout, tmp / "src", dtype=dtype_for(layout))
    convert(str(src), output=tmp / "mlx")
    return tmp / "mlx"


@pytest.fixture(scope="module")
def stock(model_dir: Path):
    """stock(prompt, n, eos=True): stock mlx-lm's greedy tokens of `prompt` alone, up to
    its EOS (excluded) or, with `eos` False, `n` tokens whatever they are."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    eos_ids = list(tokenizer.eos_token_ids)
    memo: dict[tuple[tuple[int, ...], int, bool], list[int]] = {}

    def tokens(prompt: list[int], n: int, eos: bool = True) -> list[int]:
        key = (tuple(prompt), n, eos)
        if key not in memo:
            tokenizer.eos_token_ids = eos_ids if eos else []
            out = []
            for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n):
                if r.finish_reason == "stop":
                    break
                out.append(r.token)
            memo[key] = out
        return memo[key]

    return tokens


@pytest.fixture(scope="module")
def m(model_dir: Path):
    return load_model(model_dir)


def inject_per_row(decoder: BatchDecoder, references: dict[int, list[int]],
                   plans: dict[int, list[int]], vocab: int) -> dict[int, list[int]]:  # fmt: skip
    """Row uid's k-th round drafts `references[uid]`'s next tokens, wrong from
    `plans[uid][k]` on. Returns each row's planned rights, round by round."""
    rights: dict[int, list[int]] = {uid: [] for uid in plans}

    def injected(row: Row, position: mx.array, head_drafts: mx.array) -> mx.array:
        depth = head_drafts.shape[0]  # the round's: its deepest row's
        right = min(plans[row.uid][len(rights[row.uid])], row.depth)
        rights[row.uid].append(right)
        # The position is on the device (a round built before the one before it is read).
        reference = mx.array(references[row.uid] + [0] * 8)
        at = position - len(row.prompt) + mx.arange(depth)  # past the end: a discarded round's
        truth = reference[mx.clip(at, 0, reference.shape[0] - 1)]
        drafts = mx.where(mx.arange(depth) < right, truth, (truth + 1) % vocab)
        # The head's drafts stay in the graph, as a real round computes them.
        return mx.where(head_drafts < 0, head_drafts, drafts.astype(mx.int32))

    decoder.draft_filter = injected
    return rights


def accepted_per_round(row: Row) -> list[int]:
    """Drafts the row kept in each round but its last, from where its rounds started."""
    positions = [p for p, _ in row.draft_log]
    return [b - a - 1 for a, b in zip(positions, positions[1:], strict=False)]


@pytest.mark.parametrize(("depth", "ahead"), [(1, True), (3, True), (1, False)])
def test_rows_of_equal_length_are_each_stock(m, stock, depth: int, ahead: bool) -> None:
    decoder = BatchDecoder(m, depth=depth, ahead=ahead)
    rows = decoder.generate(EQUAL, max_tokens=24)
    for row, prompt in zip(rows, EQUAL, strict=True):
        reference = stock(prompt, 24)
        assert row.tokens == reference
        assert row.finish == ("length" if len(reference) == 24 else "stop")
    assert sum(row.drafted for row in rows) > 0
    assert (decoder.rounds_ahead > 0) == ahead


@pytest.mark.parametrize("model_dir", FAMILIES, indirect=True)
def test_rows_of_different_lengths_with_partial_acceptance_per_row(
    m, stock, request: pytest.FixtureRequest
) -> None:
    """Drafts right up to a different depth in each row and round (0..4 at depth 4): each row
    keeps exactly its plan and stays its single stream, its rounds built before the round
    before them was read wherever its caches roll back on the device."""
    n = 30
    decoder = BatchDecoder(m, depth=4)
    decoder.eos = set()  # every round counts: no row ends before its n tokens
    base = [0, 4, 1, 3, 2, 4, 4, 0, 2, 1, 3]
    plans = {uid: (base[uid:] + base[:uid]) * 8 for uid in range(len(UNEQUAL))}
    references = {uid: stock(p, n, eos=False) for uid, p in enumerate(UNEQUAL)}
    rights = inject_per_row(decoder, references, plans, m.embedding.weight.shape[0])
    rows = decoder.generate(UNEQUAL, max_tokens=n)
    for row in rows:
        assert row.tokens == references[row.uid]
        accepted = accepted_per_round(row)
        assert accepted == rights[row.uid][: len(accepted)]
        assert set(accepted) == {0, 1, 2, 3, 4}
    # Rows rolled back different counts in the same round (the per-row path, not one trim).
    first = [accepted_per_round(row)[:3] for row in rows]
    assert len({tuple(a) for a in first}) == len(rows)
    family = request.node.callspec.params["model_dir"]
    assert (decoder.rounds_ahead > 0) == (family not in READ_FIRST)


@pytest.mark.parametrize(
    "model_dir", ["mimo", "deepseek_v3", "exaone_moe", "qwen3_5"], indirect=True
)
def test_rows_with_few_query_attention_by_ops(m, stock, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA GPU runs (no cuDNN build per key length): the batched verify's and the
    head's attention of a few queries computed from plain ops, over the rows' left-padded
    masks (attention, MLA, sliding windows, and the gated-delta-net hybrid's full layers);
    each row with its own partial acceptance is still its single stream."""
    from mtpkit.runtime.kernels import attention

    calls = []
    by_ops = attention.attention_by_ops

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return by_ops(*args, **kwargs)

    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.setattr(attention, "attention_by_ops", counted)
    n = 20
    decoder = BatchDecoder(m, depth=2)
    decoder.eos = set()
    plans = {uid: ([2, 0, 1] * 10)[uid:] for uid in range(len(UNEQUAL))}
    references = {uid: stock(p, n, eos=False) for uid, p in enumerate(UNEQUAL)}
    inject_per_row(decoder, references, plans, m.embedding.weight.shape[0])
    for row in decoder.generate(UNEQUAL, max_tokens=n):
        assert row.tokens == references[row.uid]
    assert calls and all(shape[0] == len(UNEQUAL) for shape in calls)


@pytest.mark.parametrize(
    "model_dir",
    [*LAYOUTS, "exaone_moe", "nemotron_h", "bailing_moe_v3", "deepseek_v32"],
    indirect=True,
)
def test_rows_join_late_and_leave_early(m, stock) -> None:
    """Continuous batching: rows join between rounds (at other cache offsets, mid-way through
    the others' partial acceptances), one ends at its max_tokens and one is removed while the
    others go on; each finished row is its single stream, a removed one a prefix of it."""
    decoder = BatchDecoder(m, depth=2)
    decoder.eos = set()
    prompts = [UNEQUAL[2], UNEQUAL[1], UNEQUAL[0], UNEQUAL[3]]
    references = {uid: stock(p, 40, eos=False) for uid, p in enumerate(prompts)}
    plans = {uid: [uid % 3, 2, 0, 1, 2, 1] * 20 for uid in references}
    inject_per_row(decoder, references, plans, m.embedding.weight.shape[0])
    long = decoder.add(UNEQUAL[2], max_tokens=40)
    short = decoder.add(UNEQUAL[1], max_tokens=7)
    for _ in range(3):
        decoder.step()
    late = decoder.add(UNEQUAL[0], max_tokens=40)
    cancelled = decoder.add(UNEQUAL[3], max_tokens=40)
    assert len(decoder.rows) == 4 - short.done
    decoder.step()
    decoder.remove(cancelled)
    assert cancelled.finish == "cancelled" and cancelled not in decoder.rows
    while decoder.rows:
        decoder.step()
    assert short.finish == "length" and short.tokens == references[1][:7]
    assert long.tokens == references[0] and late.tokens == references[2]
    assert long.finish == late.finish == "length"
    assert cancelled.tokens == references[3][: len(cancelled.tokens)]
    assert len(cancelled.tokens) > 1


def test_rows_at_different_depths_share_a_round(m, stock) -> None:
    """Rows drafting 0 (drafting off), 1, 4 and 2 tokens a round, with injected partial
    acceptances: each keeps at most its own depth and stays its single stream; when the
    deepest row leaves, the rounds go on at the deepest left."""
    decoder = BatchDecoder(m, depth=4)
    decoder.eos = set()
    depths = [0, 1, 4, 2]
    budgets = [30, 30, 12, 30]
    references = {uid: stock(p, 30, eos=False) for uid, p in enumerate(UNEQUAL)}
    plans = {uid: [4, 0, 3, 1, 2, 4] * 20 for uid in references}
    rights = inject_per_row(decoder, references, plans, m.embedding.weight.shape[0])
    rows = [decoder.add(p, max_tokens=n, depth=d)
            for p, n, d in zip(UNEQUAL, budgets, depths, strict=True)]  # fmt: skip
    while decoder.rows:
        decoder.step()
    for row, n in zip(rows, budgets, strict=True):
        assert row.tokens == references[row.uid][:n]
        accepted = accepted_per_round(row)
        assert accepted == rights[row.uid][: len(accepted)]
        assert max(accepted) == row.depth
    # a plain step a round: no speculative step of its own (vLLM's num_spec_steps)
    assert rows[0].drafted == 0 and rows[0].rounds == 0 and rows[0].stats.plain_steps == 29
    assert rows[3].rounds > rows[2].rounds


def test_a_row_alone_and_in_a_batch_decodes_alike(m) -> None:
    """The same prompt gives the same tokens alone and beside other rows, at every depth
    (nothing of a batchmate reaches it)."""
    alone = BatchDecoder(m, depth=2).generate([UNEQUAL[0]], max_tokens=20)[0].tokens
    rows = BatchDecoder(m, depth=2).generate([UNEQUAL[2], UNEQUAL[0], UNEQUAL[1]], max_tokens=20)
    assert rows[1].tokens == alone


class Schedule:
    """A drafting policy that follows a fixed pattern of drafting (True) and plain steps."""

    def __init__(self, pattern: list[bool]) -> None:
        self.pattern, self.calls = pattern, 0

    def want_draft(self, width: int) -> bool:
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]

    def record(self, width: int, drafted: bool, seconds: float, tokens: int) -> None:
        return None


@pytest.mark.parametrize(
    "model_dir",
    [*LAYOUTS, "exaone_moe", "mimo_v2_flash", "nemotron_h", "deepseek_v32"],
    indirect=True,
)
def test_plain_batched_steps_between_rounds(m, stock) -> None:
    """Plain batched steps (what adaptive drafting takes at a width where rounds do not pay)
    between drafting rounds, rows joining and leaving during a stretch of plain steps: the
    head catches up with their pairs, and every row stays its single stream (sliding windows
    through one-token steps, which rotate mlx-lm's batched window, and back)."""
    schedule = Schedule([True, False, False, True, True, False, False, False])
    decoder = BatchDecoder(m, depth=3, policy=schedule)
    decoder.eos = set()
    references = {uid: stock(p, 30, eos=False) for uid, p in enumerate(UNEQUAL)}
    plans = {uid: [3, 1, 0, 2] * 20 for uid in references}
    inject_per_row(decoder, references, plans, m.embedding.weight.shape[0])
    rows = [decoder.add(UNEQUAL[0], max_tokens=30), decoder.add(UNEQUAL[1], max_tokens=9)]
    for _ in range(2):
        decoder.step()  # a round, then a plain step: the next join finds pairs pending
    rows += [decoder.add(p, max_tokens=30) for p in UNEQUAL[2:]]
    while decoder.rows:
        decoder.step()
    for row in rows:
        assert row.tokens == references[row.uid][: row.max_tokens]
    assert decoder.plain_steps > 5 and all(row.rounds > 0 for row in rows)


def test_adaptive_drafting_per_width_stays_stock(m, stock) -> None:
    """Adaptive drafting (timed, per batch width) decides nothing that changes greedy text."""
    decoder = BatchDecoder(m, depth=2, adaptive=True)
    rows = decoder.generate(EQUAL, max_tokens=40)
    for row, prompt in zip(rows, EQUAL, strict=True):
        assert row.tokens == stock(prompt, 40)
    # Its first rounds at a width draft, then it probes plain steps there (by counts).
    assert decoder.plain_steps > 0 and all(row.rounds > 0 for row in rows)


def test_bad_requests_are_one_line_errors(m) -> None:
    from mtpkit.core.errors import MtpkitError
    from mtpkit.runtime.model import NoMtpHead

    decoder = BatchDecoder(m, depth=2)
    with pytest.raises(MtpkitError, match="the prompt is empty"):
        decoder.add([], max_tokens=4)
    with pytest.raises(MtpkitError, match=r"a row's depth must be in \[0, 2\], not 3"):
        decoder.add([5, 6], max_tokens=4, depth=3)
    with pytest.raises(MtpkitError, match="max_tokens must be at least 1"):
        decoder.add([5, 6], max_tokens=0)
    assert decoder.rows == []
    with pytest.raises(MtpkitError, match="depth must be in"):
        BatchDecoder(m, depth=99)
    headless = load_model(m.path, with_head=False)
    with pytest.raises(NoMtpHead, match="has no MTP head"):
        BatchDecoder(headless, depth=1)
