"""`mtpkit serve --decode-concurrency 4` as clients see it: a real server process decoding
several requests in one batch, called with the real `openai` client and httpx.

Every greedy answer is checked against the same prompt decoded alone, by mtpkit's `generate`
and by stock mlx-lm's `stream_generate` (`References.agreed`), whatever joins or leaves the
batch around it.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_process import ServerProcess
from tests.test_serve import TIMEOUT, References, heldout

# Prompts the example continues to their max_tokens (no early EOS), of different lengths.
LONG = [
    "def main(argv):",
    "for i in range(10):",
    "class Parser(object):\n    def __init__(self",
    "x =",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(converted: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve-batch") / "server.log"
    root = str(tmp_path_factory.getbasetemp())  # holds every test's tmp_path
    proc = ServerProcess(
        converted, log, "--decode-concurrency", "4", "--allow-model-paths", root
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT)


@pytest.fixture(scope="module")
def refs(converted: Path) -> References:
    return References(converted)


def check_answer(r, ref, ids: list[int]) -> None:
    """The text, finish reason, usage and mtp object of one request's own decode."""
    choice = r.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == ("length" if ref.generation_tokens >= MAX_TOKENS else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == ref.generation_tokens
    # Prefilled whole, or (a prompt asked before in this module) from its own cached state.
    assert r.usage.prompt_tokens_details.cached_tokens in (0, len(ids) - 1)
    mtp = r.model_extra["mtp"]
    # Issue 43: depth unset is adaptive in a batch too (1-3, as test_serve's one stream).
    assert mtp["drafter"] == "mtp" and 1 <= mtp["depth"] <= 3
    assert 0 <= mtp["accepted"] <= mtp["drafted"]


def test_concurrent_clients_each_get_their_single_stream_text(client, refs) -> None:
    """Six clients at once (four rows: two wait and join as rows leave), prompts of
    different lengths, some ending early at an EOS, one at a stop string."""
    prompts = [*LONG, *heldout(2, skip=4)]
    ids = {p: refs.text_ids(p) for p in prompts}
    expected = {p: refs.agreed(ids[p], MAX_TOKENS) for p in prompts}
    assert len({len(i) for i in ids.values()}) >= 4
    assert {r.generation_tokens >= MAX_TOKENS for r in expected.values()} == {True, False}
    stop_prompt = LONG[1]
    full = expected[stop_prompt].text
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    assert stop and full.index(stop) < len(full) // 2

    def ask(prompt: str):
        if prompt == stop_prompt:
            return client.completions.create(
                model="default_model", prompt=prompt, max_tokens=MAX_TOKENS, stop=[stop]
            )
        return client.completions.create(
            model="default_model", prompt=prompt, max_tokens=MAX_TOKENS
        )

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = dict(zip(prompts, pool.map(ask, prompts), strict=True))
    for prompt, r in answers.items():
        if prompt == stop_prompt:
            assert r.choices[0].text == full[: full.index(stop)]
            assert r.choices[0].finish_reason == "stop"
            assert r.usage.completion_tokens < MAX_TOKENS
            continue
        check_answer(r, expected[prompt], ids[prompt])


def test_rows_join_while_one_decodes_and_its_disconnect_spares_them(server, client, refs):
    """A long request decodes; others join it, finish while it still decodes (one batch:
    one at a time, they would wait for its 3500 tokens), and a streamed one is mid-decode
    when the long one's client leaves; every one still gets its own text."""
    before = server.wait_idle()["cancelled"]
    streamed_tokens = 160
    streamed_ref = refs.agreed(refs.text_ids(LONG[2]), streamed_tokens)
    joined = LONG[1], LONG[3]
    joined_refs = {p: refs.agreed(refs.text_ids(p), MAX_TOKENS) for p in joined}
    body = {"prompt": LONG[0], "max_tokens": 3500, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT
        ) as long_response:
            lines = long_response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            answers = list(pool.map(lambda p: client.completions.create(
                model="default_model", prompt=p, max_tokens=MAX_TOKENS), joined))  # fmt: skip
            assert server.health()["decoding"]  # the long one decodes still
            chunks = client.completions.create(
                model="default_model", prompt=LONG[2], max_tokens=streamed_tokens, stream=True
            )
            first = next(iter(chunks))
        # leaving the block closes the long request's connection mid-batch
        rest = [c for c in chunks]
    streamed = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert streamed == streamed_ref.text
    assert rest[-1].choices[0].finish_reason == "length"
    for prompt, r in zip(joined, answers, strict=True):
        check_answer(r, joined_refs[prompt], refs.text_ids(prompt))
    state = server.wait_idle()
    assert state["cancelled"] == before + 1  # the long one was cancelled, not finished


def test_a_next_turn_joins_from_the_cache_beside_other_rows(server, client, refs) -> None:
    """A finished request leaves its state in the prompt cache: its next turn (its prompt,
    its answer's tokens and more, as token ids), asked while another request decodes in the
    batch, prefills only what it adds and gets its own decode's text."""
    import mlx.core as mx
    import mlx_lm

    ids = refs.text_ids(LONG[1])
    first = client.completions.create(model="default_model", prompt=ids, max_tokens=MAX_TOKENS)
    answer = [
        r.token for r in mlx_lm.stream_generate(
            refs.stock, refs.tokenizer, mx.array(ids), max_tokens=MAX_TOKENS
        )
    ]  # fmt: skip
    assert first.choices[0].finish_reason == "length" and len(answer) == MAX_TOKENS
    turn = ids + answer + refs.text_ids(" and more")
    ref = refs.agreed(turn, MAX_TOKENS)
    body = {"prompt": LONG[0], "max_tokens": 3500, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as long:
        lines = long.iter_lines()  # kept: a closed iterator closes the response
        assert next(line for line in lines if line.startswith("data: "))
        r = client.completions.create(model="default_model", prompt=turn, max_tokens=MAX_TOKENS)
        assert server.health()["decoding"]  # the long one decodes still
    assert r.choices[0].text == ref.text
    assert r.usage.prompt_tokens_details.cached_tokens == len(ids) + len(answer) - 1
    server.wait_idle()


def test_seeded_samples_are_the_same_alone_and_in_a_batch(server, client) -> None:
    """A sampled request with a seed draws from its own key: the same text twice alone, and
    again while other requests share its batch."""
    server.wait_idle()

    def sampled(seed: int) -> str:
        r = client.completions.create(
            model="default_model", prompt=LONG[0], max_tokens=MAX_TOKENS, temperature=1.0,
            seed=seed,
        )  # fmt: skip
        return r.choices[0].text

    alone = sampled(7)
    assert sampled(7) == alone
    with ThreadPoolExecutor(4) as pool:
        others = [
            pool.submit(client.completions.create, model="default_model", prompt=p,
                        max_tokens=MAX_TOKENS, temperature=1.0)
            for p in LONG[1:]
        ]  # fmt: skip
        batched = pool.submit(sampled, 7)
        assert batched.result() == alone
        # The others sample without a seed: any text, an empty one (an EOS drawn first) too.
        assert all(f.result().choices[0].finish_reason in ("stop", "length") for f in others)
    # Another seed draws another text (40 tokens at temperature 1 agreeing is not chance).
    assert sampled(8) != alone


def test_another_model_by_path_decodes_alone_while_the_batch_waits(
    server, client, refs, converted: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-model"
    shutil.copytree(converted, other)
    ids = refs.text_ids(LONG[3])
    ref = refs.agreed(ids, 60)
    short = refs.agreed(refs.text_ids(LONG[1]), 12)
    chunks = client.completions.create(
        model="default_model", prompt=LONG[3], max_tokens=60, stream=True
    )
    first = next(iter(chunks))  # its row is in the batch
    r = client.completions.create(model=str(other), prompt=LONG[1], max_tokens=12)
    assert r.choices[0].text == short.text and r.model == str(other)
    text = first.choices[0].text + "".join(c.choices[0].text for c in chunks)
    assert text == ref.text


def test_fields_the_batch_cannot_honour_decode_alone_beside_it(client, refs) -> None:
    """A penalty and logprobs while other requests decode in the batch: the request decodes
    as one stream (the batch waits), giving stock mlx-lm's text and log-probabilities."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_logits_processors

    ids = refs.text_ids(LONG[0])
    processors = make_logits_processors(repetition_penalty=1.3, repetition_context_size=8)
    stock = [
        (r.token, r.logprobs[r.token].item())
        for r in mlx_lm.stream_generate(
            refs.stock, refs.tokenizer, mx.array(ids), max_tokens=MAX_TOKENS,
            logits_processors=processors,
        )
    ]  # fmt: skip
    fields = {"repetition_penalty": 1.3, "repetition_context_size": 8, "logprobs": True}
    with ThreadPoolExecutor(3) as pool:
        others = [
            pool.submit(client.completions.create, model="default_model", prompt=p,
                        max_tokens=MAX_TOKENS)
            for p in LONG[1:3]
        ]  # fmt: skip
        r = client.completions.create(
            model="default_model", prompt=ids, max_tokens=MAX_TOKENS, extra_body=fields
        )
        for other in others:
            assert other.result().choices[0].text
    content = r.choices[0].logprobs.model_extra["content"]
    assert [e["id"] for e in content] == [t for t, _ in stock]
    assert all(abs(e["logprob"] - lp) < 1e-2 for e, (_, lp) in zip(content, stock, strict=True))
    assert r.model_extra["mtp"]["drafted"] > 0


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "draft-model"])
def test_without_a_drafter_clients_decode_in_one_batch(
    converted: Path, refs, tmp_path: Path, drafter: str
) -> None:
    """Issue 43: `--no-mtp --decode-concurrency 4` batches (plain batched steps), and so do
    `--prompt-lookup` and `--draft-model DIR` (here the model itself), where each used to
    decode one request at a time; each answer is stock mlx-lm's text alone."""
    flags = {"none": ["--no-mtp"], "prompt-lookup": ["--prompt-lookup"],
             "draft-model": ["--draft-model", str(converted)]}[drafter]  # fmt: skip
    proc = ServerProcess(converted, tmp_path / "server.log", *flags,
                         "--decode-concurrency", "4")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=TIMEOUT)
        with ThreadPoolExecutor(len(LONG)) as pool:
            answers = list(pool.map(lambda p: client.completions.create(
                model="default_model", prompt=p, max_tokens=MAX_TOKENS), LONG))  # fmt: skip
        for prompt, r in zip(LONG, answers, strict=True):
            text, count = refs.stock_text(refs.text_ids(prompt), MAX_TOKENS)
            assert r.choices[0].text == text and r.usage.completion_tokens == count
            assert r.model_extra["mtp"]["drafter"] == drafter
    finally:
        proc.stop()
    log = (tmp_path / "server.log").read_text()
    assert f"drafter: {drafter}, decode concurrency: 4" in log and "Traceback" not in log
    assert "decode one at a time" not in log


def test_sigterm_ends_every_row_and_the_server(server) -> None:
    """Last in the module: SIGTERM while two rows decode ends both streams with a
    `shutting_down` error event and `[DONE]`, and the process with status 0."""
    url = server.url + "/v1/completions"
    server.wait_idle()
    streams: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        body = {"prompt": LONG[i], "max_tokens": 3500, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line:
                    streams[i].append(line)
                    started[i].set()
        started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(s.wait(TIMEOUT) for s in started) and all(streams)
    assert server.terminate() == 0, server.log_path.read_text()[-4000:]
    for t in threads:
        t.join(TIMEOUT)
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        assert '"shutting_down"' in lines[-2]
    log = server.log_path.read_text()
    assert "Traceback" not in log
    assert "decode concurrency: 4" in log
