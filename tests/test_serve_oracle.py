"""`mtpkit serve --oracle-acceptance A` (SYNTHETIC, for benchmarks): a real server process whose
greedy answers of a prompt it has answered before are decoded with oracle drafts, one stream
and in batched rows.

Held to: the texts of stock mlx-lm's own greedy decode (`References.agreed`), whatever the
oracle keeps; the plan's share A, realized in the responses' own counts (vLLM's histogram: the
first draft's share kept). The tolerance, 0.1: the plan's golden-ratio sequence realizes A
within 0.1 over any 15 or more rounds from any of 2,000 seeded offsets (at A = 0.8), and every
request here drafts at least 20 rounds (depth 2, no adaptive drafting, no early EOS); at
A = 0 nothing is ever kept.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from tests.serve_process import ServerProcess
from tests.test_serve import TIMEOUT, References, heldout
from tests.test_serve_batch import LONG

MAX_TOKENS = 64
TOLERANCE = 0.1
MIN_ROUNDS = 20

runner = CliRunner()


@pytest.fixture(scope="module")
def refs(converted: Path) -> References:
    return References(converted)


@pytest.fixture(scope="module")
def expected(refs: References) -> dict[str, str]:
    """Each prompt's greedy text, mtpkit generate's and stock mlx-lm's alike."""
    return {p: refs.agreed(refs.text_ids(p), MAX_TOKENS).text for p in LONG}


@pytest.fixture(scope="module", params=[0.8, 0.0])
def oracle_server(request, converted: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve-oracle") / "server.log"
    proc = ServerProcess(
        converted, log, "--oracle-acceptance", str(request.param), "--decode-concurrency", "4",
        "--no-adaptive", "--depth", "2",
    )  # fmt: skip
    yield proc, request.param
    proc.stop()


def complete(url: str, prompt: str, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)


def answers(url: str, prompts: list[str], clients: int, **fields) -> list[dict]:
    with ThreadPoolExecutor(clients) as pool:
        responses = list(pool.map(lambda p: complete(url, p, **fields), prompts))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def first_draft_share(bodies: list[dict]) -> float:
    spec = [b["metrics"]["speculative_decoding"] for b in bodies]
    for s in spec:
        assert s["num_spec_steps"] >= MIN_ROUNDS
    steps = sum(s["num_spec_steps"] for s in spec)
    return (steps - sum(s["acceptance_histogram"][0] for s in spec)) / steps


def test_oracle_drafts_realize_their_acceptance_with_greedy_texts(oracle_server, expected):
    """First answers decode with the head (and are kept); then the same prompts one stream
    alone (log-probabilities: a one-stream decode), one client at a time (a batch of one row),
    and four clients at once (four rows) decode with oracle drafts at A."""
    server, acceptance = oracle_server
    first = answers(server.url, LONG, clients=4)
    assert [b["choices"][0]["text"] for b in first] == [expected[p] for p in LONG]
    assert all(b["mtp"]["synthetic_acceptance"] is None for b in first)
    runs = {
        "one stream": answers(server.url, LONG, clients=1, logprobs=1),
        "one client": answers(server.url, LONG, clients=1),
        "four clients": answers(server.url, LONG, clients=4),
    }
    for name, bodies in runs.items():
        assert [b["choices"][0]["text"] for b in bodies] == [expected[p] for p in LONG], name
        for b in bodies:
            assert b["mtp"]["synthetic_acceptance"] == acceptance, name
            assert b["mtp"]["depth"] == 2 and b["mtp"]["drafted"] > 0
        share = first_draft_share(bodies)
        if acceptance == 0.0:
            assert share == 0.0 and all(b["mtp"]["accepted"] == 0 for b in bodies), name
        else:
            assert abs(share - acceptance) <= TOLERANCE, (name, share)
    assert server.health()["status"] == "ok"


def test_rows_of_either_kind_share_a_batch_and_a_longer_answer_is_kept(
    oracle_server, expected, refs
) -> None:
    """Two oracle rows beside two rows the head drafts (prompts not answered before) in one
    batch, each with its own text; a request longer than the kept answer decodes with the
    head, and the longer answer it leaves is the one the next request's oracle drafts over."""
    server, acceptance = oracle_server
    fresh = heldout(2, skip=6)
    texts = {**expected, **{p: refs.agreed(refs.text_ids(p), MAX_TOKENS).text for p in fresh}}
    answers(server.url, LONG[:2], clients=2)  # answered before (if not by the test above)
    prompts = [LONG[0], fresh[0], LONG[1], fresh[1]]
    bodies = answers(server.url, prompts, clients=4)
    assert [b["choices"][0]["text"] for b in bodies] == [texts[p] for p in prompts]
    marks = [b["mtp"]["synthetic_acceptance"] for b in bodies]
    assert marks == [acceptance, None, acceptance, None]
    assert abs(first_draft_share([bodies[0], bodies[2]]) - acceptance) <= TOLERANCE
    longer = refs.agreed(refs.text_ids(LONG[2]), 2 * MAX_TOKENS).text
    answers(server.url, [LONG[2]], clients=1)
    for mark in (None, acceptance):
        (body,) = answers(server.url, [LONG[2]], clients=1, max_tokens=2 * MAX_TOKENS)
        assert body["choices"][0]["text"] == longer
        assert body["mtp"]["synthetic_acceptance"] == mark


def test_sampling_and_processors_are_refused(oracle_server, expected) -> None:
    server, _ = oracle_server
    for fields, param in (
        ({"temperature": 0.7}, "temperature"),
        ({"logit_bias": {"5": 2.0}}, "logit_bias"),
        ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ):
        r = complete(server.url, LONG[0], **fields)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "--oracle-acceptance" in error["message"]
    r = complete(server.url, LONG[0])  # the server lives on
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected[LONG[0]]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--oracle-acceptance", "1.5"], "--oracle-acceptance"),
        (["--oracle-acceptance", "0.8", "--no-mtp"], "it takes no --no-mtp"),
        (["--oracle-acceptance", "0.8", "--prompt-lookup"], "it takes no --no-mtp"),
        (["--oracle-acceptance", "0.8", "--temp", "0.5"], "--temp must be 0"),
        (["--oracle-acceptance", "0.8", "--allow-model-paths", "."], "--allow-model-paths"),
    ],
)
def test_bad_oracle_options_are_usage_errors(args, message, converted: Path) -> None:
    result = runner.invoke(app, ["serve", "--model", str(converted), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_verdicts_held_to_the_plan_beside_a_row_that_is_not(converted: Path, refs) -> None:
    """The hold itself, which the server needs on a GPU (where a random model's verify pass
    and plain steps part ways), shown on a CPU with a reference that is not the greedy one:
    at A = 1 a row keeps every draft of it whatever the verify pass says, one stream and in a
    batch beside a row without an oracle, whose text stays stock mlx-lm's. The batch's caches
    rolled back on the device by the planned counts are checked too: each token the backbone
    chose after the kept drafts is stock mlx-lm's argmax over the prompt and the output so far
    (one forward pass over the whole sequence)."""
    import mlx.core as mx

    from mtpkit.speculative.batch import BatchSession
    from mtpkit.speculative.oracle import Oracle
    from mtpkit.speculative.session import Engine, Request

    engine = Engine.load(converted, mtp=True)
    prompt, other = refs.text_ids(LONG[0]), refs.text_ids(LONG[1])
    vocab = int(engine.m.embedding.weight.shape[0])
    wrong = Oracle(tuple((7 * i + 3) % vocab for i in range(MAX_TOKENS + 8)), 1.0, seed=1)
    held = dict(max_tokens=MAX_TOKENS, depth=2, adaptive=False, oracle=wrong)
    session = engine.session(Request(prompt, **held))
    list(session)
    assert session.stats.accepted == session.stats.drafted > 0
    batch = BatchSession(engine, adaptive=False)
    row = batch.add(Request(prompt, **held))
    plain = batch.add(Request(other, max_tokens=MAX_TOKENS, depth=2, adaptive=False))
    while batch.entries:
        batch.step()
    assert row.stats.accepted == row.stats.drafted > 0
    assert plain.text == refs.agreed(other, MAX_TOKENS).text
    output = list(row.row.tokens)
    logits = refs.stock(mx.array([prompt + output]))
    argmax = mx.argmax(logits[0, len(prompt) - 1 : -1], axis=-1).tolist()
    positions = [i for i in range(1, len(output)) if i % 3 == 0]  # 2 drafts, then its token
    assert positions and all(output[i] == argmax[i] for i in positions)
    assert output[1:3] == list(wrong.reference[1:3])
