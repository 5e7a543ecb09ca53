"""`mtpkit serve` beside `mlx_lm.server` on one directory, with the fields and routes clients
send: log-probabilities (chat and completions, streamed too) equal to mlx_lm.server's; the
sampling fields it honours (penalties, logit bias, XTC) giving its greedy text; fields
mtpkit cannot honour refused by name; mlx_lm.server's model id and routes; 400s said in the
user's words; keepalive comments while a stream waits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from tests.mlx_lm_server import MlxLmServer
from tests.serve_clients import templated_model
from tests.serve_process import ServerProcess

TIMEOUT = 300.0
EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
NAME = "tiny-served"


def heldout(i: int) -> str:
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return " ".join(lines[i].split()[:8])


@pytest.fixture(scope="module")
def model(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return templated_model(converted, tmp_path_factory.mktemp("fields") / "model")


@pytest.fixture(scope="module")
def servers(model: Path):
    ours = ServerProcess(model, model.parent / "mtpkit.log", "--served-model-name", NAME)
    try:
        theirs = MlxLmServer(model, model.parent / "mlx_lm.log")
    except Exception:
        ours.stop()
        raise
    yield ours, theirs
    ours.stop()
    theirs.stop()


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def chosen(logprobs: dict) -> list[tuple[int, float]]:
    return [(e["id"], e["logprob"]) for e in logprobs["content"]]


def close(ours: list[tuple[int, float]], theirs: list[tuple[int, float]]) -> None:
    assert [i for i, _ in ours] == [i for i, _ in theirs]
    assert all(abs(a - b) < 1e-2 for (_, a), (_, b) in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_logprobs_are_mlx_lm_servers(servers, chat) -> None:
    ours, theirs = servers
    path = "/v1/chat/completions" if chat else "/v1/completions"
    text = heldout(15 if chat else 19)
    base = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    base["max_tokens"] = 16
    mine = post(ours, path, {**base, "logprobs": True, "top_logprobs": 3})
    reference = post(theirs, path, {**base, "logprobs": True})
    close(chosen(mine["choices"][0]["logprobs"]), chosen(reference["choices"][0]["logprobs"]))
    assert len(reference["choices"][0]["logprobs"]["content"]) == mine["usage"]["completion_tokens"]
    tops = post(theirs, path, {**base, "top_logprobs": 3})["choices"][0]["logprobs"]["content"]
    for entry, ref in zip(mine["choices"][0]["logprobs"]["content"], tops, strict=True):
        top = entry["top_logprobs"]
        assert sorted(t["id"] for t in top) == sorted(t["id"] for t in ref["top_logprobs"])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    assert mine["mtp"]["drafted"] > 0  # the speculative path scored them
    if not chat:  # OpenAI's legacy lists, as the openai client reads them
        legacy = openai.OpenAI(base_url=ours.url + "/v1", api_key="x").completions.create(
            model=NAME, prompt=text, max_tokens=16, logprobs=3
        )
        lp = legacy.choices[0].logprobs
        assert lp.token_logprobs == [
            e["logprob"] for e in mine["choices"][0]["logprobs"]["content"]
        ]
        assert len(lp.top_logprobs[0]) == 3 and lp.text_offset[0] == 0


def test_streamed_logprobs_are_the_answers(servers) -> None:
    ours = servers[0]
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="x", timeout=TIMEOUT)
    messages = [{"role": "user", "content": heldout(15)}]
    whole = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, logprobs=True, top_logprobs=2
    )
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [
        e
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    expected = whole.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in expected]
    assert [len(e.top_logprobs) for e in streamed] == [2] * len(expected)


FIELDS = [
    (15, {"repetition_penalty": 1.5, "repetition_context_size": 8}),
    (20, {"presence_penalty": 1.5, "frequency_penalty": 1.0, "presence_context_size": 8,
          "frequency_context_size": 8}),
    (17, {"logit_bias": {"279": 4.0, "264": 3.0}}),
]  # fmt: skip


@pytest.mark.parametrize(("line", "fields"), FIELDS, ids=["repetition", "presence", "bias"])
def test_sampling_fields_give_mlx_lm_servers_greedy_text(servers, line, fields) -> None:
    ours, theirs = servers
    body = {"prompt": heldout(line), "max_tokens": 24}
    plain = post(ours, "/v1/completions", body)["choices"][0]["text"]
    mine = post(ours, "/v1/completions", {**body, **fields})
    reference = post(theirs, "/v1/completions", {**body, **fields})
    assert mine["choices"][0]["text"] == reference["choices"][0]["text"]
    assert mine["choices"][0]["text"] != plain  # the field changed the text
    assert mine["mtp"]["drafted"] > 0


def test_xtc_is_mlx_lm_servers(servers) -> None:
    ours, theirs = servers
    body = {"prompt": heldout(19), "max_tokens": 24, "xtc_probability": 0.9, "xtc_threshold": 0.05}
    greedy = post(ours, "/v1/completions", body)  # greedy: mlx-lm's sampler is the argmax
    assert (
        greedy["choices"][0]["text"] == post(theirs, "/v1/completions", body)["choices"][0]["text"]
    )
    sampled = post(ours, "/v1/completions", {**body, "temperature": 0.8, "seed": 3})
    assert sampled["mtp"]["drafted"] == 0  # XTC's cut cannot judge a draft: plain decoding


REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"best_of": 2}, "best_of"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_fields_it_cannot_honour_are_refused_by_name(servers, fields, param) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    r = httpx.post(servers[0].url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"].startswith(param)


def test_mlx_lm_servers_ids_and_routes(servers, model: Path) -> None:
    ours, theirs = servers
    listed = httpx.get(ours.url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [m["id"] for m in listed] == [NAME]  # --served-model-name
    body = {"prompt": heldout(12), "max_tokens": 8}
    text = post(ours, "/v1/completions", body)["choices"][0]["text"]
    for name in (NAME, str(model.resolve()), "default_model"):  # the absolute path: mlx_lm's id
        assert post(ours, "/v1/completions", {**body, "model": name})["choices"][0]["text"] == text
    assert post(ours, "/completions", body)["choices"][0]["text"] == text
    chat = {"messages": [{"role": "user", "content": heldout(12)}], "max_tokens": 8}
    assert (
        post(ours, "/chat/completions", chat)["choices"]
        == post(ours, "/v1/chat/completions", chat)["choices"]
    )
    client = openai.OpenAI(base_url=ours.url + "/v1", api_key="x")
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(ours.url + "/models", timeout=TIMEOUT).json()["data"][0]["id"] == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert post(theirs, "/v1/completions", body)["choices"][0]["text"] == text


def test_a_prompt_of_ids_in_a_list_is_lm_evals_and_one_prompt(servers) -> None:
    ids = [279, 264, 300, 411, 52]
    one = post(servers[0], "/v1/completions", {"prompt": ids, "max_tokens": 8})
    nested = post(servers[0], "/v1/completions", {"prompt": [ids], "max_tokens": 8})
    assert nested["choices"][0]["text"] == one["choices"][0]["text"]
    r = httpx.post(servers[0].url + "/v1/completions", json={"prompt": [ids, ids]}, timeout=TIMEOUT)
    assert r.status_code == 400 and "one prompt per request" in r.json()["error"]["message"]


def test_misleading_400s_are_said_in_the_users_words(servers) -> None:
    url = servers[0].url
    image = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]}]}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=image, timeout=TIMEOUT).json()["error"]
    assert r["message"] == (
        "messages.0.content: this server reads text only: 'image_url' content parts cannot "
        "be sent to this model"
    )
    assert ".str" not in r["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": [[1, "a"]]}, timeout=TIMEOUT)
    assert (
        r.json()["error"]["message"] == "prompt: must be a string or a list of token ids (integers)"
    )
    # plain `curl -d '{...}'` sends application/x-www-form-urlencoded
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = httpx.post(
        url + "/v1/completions", content=b'{"prompt": "hi"}', headers=form, timeout=TIMEOUT
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        "the body must be JSON sent with `Content-Type: application/json`"
    )
    assert "valid dictionary" not in r.json()["error"]["message"]


def test_a_waiting_stream_sends_headers_and_keepalive_comments() -> None:
    """The SSE generator over a job whose first event comes late: keepalive comments first."""
    from mtpkit.serve import stream
    from mtpkit.serve.schemas import ResponseIds
    from mtpkit.serve.worker import Job
    from mtpkit.speculative.session import TokenEvent

    class Body:
        tools, tool_choice = None, None

        def top_tokens(self) -> None:
            return None

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        job = Job(lambda _e: None, None, loop)
        shaping = stream.Shaping(None, Body(), chat=False, streaming=True)
        loop.call_later(stream.KEEPALIVE_EVERY * 2.5, job.events.put_nowait, TokenEvent(5, "hi"))
        out = []
        async for piece in stream.sse(job, ResponseIds(False, "m"), None, False, shaping):
            out.append(piece)
            if piece.startswith("data:"):
                break
        return out

    pieces = asyncio.run(run())
    assert pieces[:3] == [": keepalive\n\n"] * 3
    assert '"text": "hi"' in pieces[3]
