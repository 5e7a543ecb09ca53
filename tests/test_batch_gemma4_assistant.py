"""Gemma 4's assistant in a batch (`AssistantRows`), proved row by row against stock mlx-lm,
against the one-stream assistant over the row's own caches, and against each row alone.

The assistant reads the batch's target caches (mlx-lm's `BatchKVCache` and
`BatchRotatingKVCache`: rows left-padded on one write index, a sliding window of 8 that
prompts, rounds and plain steps cross and rotate). Every greedy row must be its prompt's
tokens alone with stock `mlx_lm.stream_generate`, with rows of different prompt lengths at
different depths, plain steps between rounds, a row joining late, one leaving early at its
max_tokens and one removed mid-way. Before every round, each row's batched drafts must be
those the one-stream `AssistantProposer` drafts over that row alone (its caches taken out of
the batch by mlx-lm's own `extract`, its hidden state and token): a padding, an offset or a
window read wrong for any row would draft otherwise. With every step a round, each row's
drafts round by round must be the ones it drafts decoding alone (`MtpDecoder`): the batch's
bookkeeping of each row's target state is then its single stream's too.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.batch import BatchDecoder
from mtpkit.speculative.decode import MtpDecoder
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.proposers.gemma4_assistant import AssistantProposer
from mtpkit.speculative.proposers.gemma4_assistant_rows import AssistantRows
from tests.gemma4_checkpoints import build_assistant, build_target
from tests.test_batch import Schedule
from tests.test_batch_plain import stock_greedy
from tests.test_generate_sampling import CHI2_999, chi_square, exact_pairs

PROMPT = [5, 17, 100, 3, 250, 42, 7, 9, 300, 11, 64, 128]  # past the window of 8
# Lengths 12, 3, 21 and 2: rows left-padded differently, two inside the window, two past it;
# with the agreeing pair each keeps some drafts and rejects others.
PROMPTS = [PROMPT, PROMPT[:3], [*range(30, 50), 11], [200, 11]]
DEPTHS = [3, 1, 2, 2]
N = 20


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """The agreeing pair (a dense assistant: drafts kept and rejected) and a random target
    with a centroid-masked assistant (drafts rejected), by name."""
    root = tmp_path_factory.mktemp("gemma4rows")
    return {
        "agreeing": (
            build_target(root / "agreeing", agreeing=True),
            build_assistant(root / "agreeing-dense", agreeing=True),
        ),
        "masked": (build_target(root / "target"), build_assistant(root / "masked", ordered=True)),
    }


def one_stream_drafts(rows: AssistantRows, r: int, depth: int) -> list[int]:
    """Row r's greedy drafts by the one-stream assistant over row r alone: its target caches
    taken out of the batch's (mlx-lm's `extract`; a window cut to the entries the row's one
    stream holds, `AssistantRows.held`, which the next test holds to the row's own single
    stream), its hidden state and last token."""
    alone = AssistantProposer(rows.m, rows.assistant)
    caches = [cache.extract(r) for cache in rows.target_cache]
    window = caches[rows.reader.sources["sliding_attention"]]
    held = rows.held[r]
    if window.keys.shape[2] > held:
        window.keys, window.values = window.keys[..., -held:, :], window.values[..., -held:, :]
        window._idx = held
    alone.attach(caches)
    alone.hidden = rows.hidden[r : r + 1]
    alone.last_token = int(rows.last[r, 0].item())
    return alone.propose(depth, SamplingSettings()).drafts.tolist()


def checking(proposer: AssistantProposer, checks: list[tuple[list[Any], list[Any]]]) -> Any:
    """`proposer`, whose batch's drafter logs, before each round, every row's one-stream
    drafts beside its batched ones."""
    batched = proposer.batched

    def rows() -> AssistantRows:
        drafter = batched()
        own = drafter.propose

        def propose(depths, sampling, keys):
            depth = max(depths)
            alone = [one_stream_drafts(drafter, r, depth) for r in range(len(depths))]
            proposal = own(depths, sampling, keys)
            checks.append((alone, proposal.drafts.tolist()))
            return proposal

        drafter.propose = propose
        return drafter

    proposer.batched = rows
    return proposer


def decode_joining_and_leaving(target: Path, assistant: Path, checks: list, policy=None) -> list:
    """Rows of `PROMPTS` at `DEPTHS`: rows 0 and 1 first (row 1 ends early, at 5 tokens),
    three steps, row 2 joins, row 3 joins and is removed after one more step. `policy`:
    the batch's drafting schedule (default a round, then two plain steps)."""
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=assistant))
    schedule = policy if policy is not None else Schedule([True, False, False])
    decoder = BatchDecoder(m, depth=3, proposers=lambda: checking(factory(), checks),
                           policy=schedule)  # fmt: skip
    decoder.eos = set()
    first = decoder.add(PROMPTS[0], max_tokens=N, depth=DEPTHS[0])
    short = decoder.add(PROMPTS[1], max_tokens=5, depth=DEPTHS[1])
    for _ in range(3):
        decoder.step()
    assert isinstance(decoder.proposer, AssistantRows)
    late = decoder.add(PROMPTS[2], max_tokens=N, depth=DEPTHS[2])
    removed = decoder.add(PROMPTS[3], max_tokens=N, depth=DEPTHS[3])
    decoder.step()
    decoder.remove(removed)
    while decoder.rows:
        decoder.step()
    assert short.finish == "length" and removed.finish == "cancelled"
    return [first, short, late, removed]


@pytest.mark.parametrize("name", ["agreeing", "masked"])
def test_rows_are_stock_and_draft_as_the_one_stream_assistant(pairs, name) -> None:
    target, assistant = pairs[name]
    references = stock_greedy(target, PROMPTS, N)
    checks: list = []
    rows = decode_joining_and_leaving(target, assistant, checks)
    first, short, late, removed = (r.tokens for r in rows)
    assert first == references[0] and late == references[2]
    assert short == references[1][:5]
    assert 0 < len(removed) < N and removed == references[3][: len(removed)]
    assert all(row.drafted > 0 for row in rows)
    assert len(checks) > 4 and max(len(alone) for alone, _ in checks) == 4  # four rows at once
    for alone, batched in checks:
        assert batched == alone
    if name == "agreeing":  # rounds kept some drafts and rejected others
        assert 0 < sum(r.accepted for r in rows) < sum(r.drafted for r in rows)


def test_every_round_drafts_as_each_row_alone(pairs) -> None:
    """Every step a round: each row's drafts, round by round at the same positions, are its
    prompt's decoding alone (`MtpDecoder`, the one-stream decoder, at the row's depth)."""
    target, assistant = pairs["agreeing"]
    rows = decode_joining_and_leaving(target, assistant, [], policy=Schedule([True]))
    m = load_model(target, with_head=False)
    m.tokenizer.eos_token_ids = []
    factory = ProposerFactory(m, DrafterChoice(draft_model=assistant))
    shared = 0
    for r, row in enumerate(rows):
        alone = MtpDecoder(m, PROMPTS[r], depth=DEPTHS[r], adaptive=False, proposer=factory(),
                           sampling=SamplingSettings())  # fmt: skip
        assert list(alone.tokens(len(row.tokens))) == row.tokens
        by_position = dict(alone.stats.draft_log)
        for position, drafts in row.stats.draft_log:
            if position in by_position:
                shared += 1
                assert drafts == by_position[position][: len(drafts)], (r, position)
    assert shared >= 10


def test_each_sampled_row_keeps_its_distribution(pairs) -> None:
    """Two sampled rows with different settings and prompts beside a greedy row: each's
    first two tokens follow the target's exact joint distribution under its own settings
    (chi-square at p = 0.001), the assistant's drafts both kept and resampled."""
    target, assistant = pairs["agreeing"]
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=assistant))
    settings = [SamplingSettings(temp=1.0, top_k=3), SamplingSettings(temp=0.7, top_k=2)]
    prompts = [PROMPT, PROMPTS[2]]
    exact = [exact_pairs(m, p, s) for p, s in zip(prompts, settings, strict=True)]
    counts: list[Counter] = [Counter(), Counter()]
    drafted = accepted = 0
    n = 300
    for seed in range(n):
        mx.random.seed(seed)
        decoder = BatchDecoder(m, depth=2, proposers=factory)
        decoder.eos = set()
        rows = [decoder.add(p, max_tokens=2, sampling=s) for p, s in zip(prompts, settings,
                                                                            strict=True)]  # fmt: skip
        greedy = decoder.add(PROMPTS[3], max_tokens=2)
        while decoder.rows:
            decoder.step()
        assert isinstance(decoder.proposer, AssistantRows) or decoder.proposer is None
        for i in range(2):
            counts[i][tuple(rows[i].tokens)] += 1
        drafted += rows[0].drafted + rows[1].drafted
        accepted += rows[0].accepted + rows[1].accepted
        assert len(greedy.tokens) == 2
    assert 0 < accepted < drafted  # both the accept and the resample paths ran
    for i in range(2):
        index = {k: j for j, k in enumerate(sorted(exact[i]))}
        observed = Counter({index.get(k, -1): v for k, v in counts[i].items()})
        stat, dof = chi_square(observed, {index[k]: v for k, v in exact[i].items()}, n)
        assert stat < CHI2_999[dof], (i, stat, dof)


def test_a_seeded_sampled_row_draws_alike_alone_and_in_a_batch(pairs) -> None:
    """A sampled row with a seed draws its drafts and verdicts from its own key: the same
    tokens alone and beside other rows."""
    target, assistant = pairs["agreeing"]
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=assistant))

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


# --------------------------------------------------------------------------- the commands


def test_generate_and_bench_decode_the_assistant_in_a_batch(pairs) -> None:
    """`generate -p A -p B --draft-model ASSISTANT` decodes one batch (each request stock
    mlx-lm's tokens alone, the batch's drafter the assistant), and so does `bench --batch`
    (the assistant's rows against stock's batching), where both used to refuse it."""
    import json

    from typer.testing import CliRunner

    from mtpkit.cli.app import app
    from tests.stock import stock_tokens

    target, assistant = pairs["agreeing"]
    texts = ["hello world", "a b c d e f g h i j k"]
    args = [a for t in texts for a in ("-p", t)]
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "--model", str(target), "--draft-model",
                                 str(assistant), *args, "-m", "12", "--no-chat-template",
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["batch"] == 2 and out["drafter"] == "gemma4-assistant"
    m = load_model(target, with_head=False)
    for text, request in zip(texts, out["requests"], strict=True):
        assert request["tokens"] == stock_tokens(target, m.tokenizer.encode(text), 12), text
        assert request["drafter"] == "gemma4-assistant" and request["drafted"] > 0
    bench = runner.invoke(app, ["bench", "--model", str(target), "--draft-model", str(assistant),
                                "--batch", "2", "--trials", "1", "--max-tokens", "6",
                                "--json"])  # fmt: skip
    assert bench.exit_code == 0, bench.output
    report = json.loads(bench.stdout)
    assert report["drafter"] == "gemma4-assistant" and [w["batch"] for w in report["widths"]] == [2]
    assert report["widths"][0]["mtp"]["gemma4-assistant"]["tps"]["median"] > 0


def test_serve_batches_the_assistant(pairs, tmp_path) -> None:
    """`serve --draft-model ASSISTANT --decode-concurrency 2`: the worker decodes one batch
    (its log says so, and nothing decodes alone), and concurrent completions over token ids
    each get stock mlx-lm's greedy text alone."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from mlx_lm import load

    from tests.serve_process import ServerProcess
    from tests.stock import stock_tokens

    target, assistant = pairs["agreeing"]
    _, tokenizer = load(str(target))
    prompts = [PROMPT, PROMPTS[2], PROMPTS[3]]
    server = ServerProcess(target, tmp_path / "server.log", "--draft-model", str(assistant),
                           "--decode-concurrency", "2")  # fmt: skip

    def complete(prompt: list[int]) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=600.0)

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
    finally:
        server.stop()
    for prompt, r in zip(prompts, answers, strict=True):
        assert r.status_code == 200, r.text
        expected = tokenizer.decode(stock_tokens(target, prompt, 12))
        assert r.json()["choices"][0]["text"] == expected
        assert r.json()["mtp"]["drafter"] == "gemma4-assistant"
    log = (tmp_path / "server.log").read_text()
    assert "drafter: gemma4-assistant, decode concurrency: 2" in log
    assert "one at a time" not in log and "Traceback" not in log


def test_a_batched_turn_leaves_the_assistants_state_for_the_next(pairs) -> None:
    """A turn decoded in a batch leaves its row (`take`: the target's caches and the
    assistant's state, out of the batch's) in the prompt cache; the next turn, alone,
    prefills only what it adds and gets the tokens and every round's drafts a fresh engine
    gives it."""
    from mtpkit.speculative.batch import BatchSession
    from mtpkit.speculative.session import Engine, Request

    target, assistant = pairs["agreeing"]
    m = load_model(target, with_head=False)
    m.tokenizer.eos_token_ids = []
    choice = DrafterChoice(draft_model=assistant)
    chat = Engine(m, drafter=choice)
    batch = BatchSession(chat, adaptive=False)
    entry = batch.add(Request(PROMPTS[2], max_tokens=9, depth=2))
    batch.add(Request(PROMPTS[1], max_tokens=13, depth=1))
    while batch.entries:
        batch.step()
    generated = entry.stats.generated
    assert len(generated) == 9 and entry.stats.proposer == "gemma4-assistant"
    turn = Request([*PROMPTS[2], *generated, 300, 11], max_tokens=10, depth=3, adaptive=False)
    session = chat.session(turn)
    tokens = [e.token for e in session if e.token is not None]
    assert session.stats.cached_tokens >= len(PROMPTS[2]) + len(generated) - 1
    fresh = Engine(m, drafter=choice, prompt_cache_size=0).session(turn)
    assert tokens == [e.token for e in fresh if e.token is not None]
    assert session.stats.draft_log == fresh.stats.draft_log and session.stats.accepted > 0
