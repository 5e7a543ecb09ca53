"""`mtpkit serve` as a client sees it: a real server process on a loopback port, called with
the real `openai` client and raw HTTP (httpx).

Answers are checked against two independent decodes in this process: mtpkit's own `generate`
(greedy, the MTP head drafting) and stock mlx-lm's `stream_generate` on a fresh load of the
same directory (the bundled example, converted).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import mlx_lm
import openai
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.generate import generate
from tests.serve_process import ServerProcess

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
API_KEY = "test-key"
# The example's tokenizer has no chat template; the server is given this one (--chat-template).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_TOKENS = 24
TIMEOUT = 600.0


def heldout(n: int, skip: int = 0) -> list[str]:
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return [" ".join(line.split()[:8]) for line in lines[skip : skip + n]]


@pytest.fixture(scope="module")
def server(converted: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = ServerProcess(
        converted, log, "--chat-template", TEMPLATE, "--api-key", API_KEY, "--log-level", "INFO"
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=TIMEOUT)


class References:
    """Greedy decodes of a prompt's token ids by mtpkit generate and by stock mlx-lm."""

    def __init__(self, path: Path) -> None:
        self.m = load_model(path)
        self.stock, self.tokenizer = mlx_lm.load(str(path))
        self.hf = self.tokenizer._tokenizer  # the Hugging Face tokenizer, for the template

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self.hf.apply_chat_template(
            messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def text_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))  # as mlx_lm.server encodes a prompt

    def stock_text(self, ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
        """Stock mlx-lm's text and its token count (with the EOS, as mlx_lm.server counts)."""
        text, count = "", 0
        for r in mlx_lm.stream_generate(
            self.stock, self.tokenizer, mx.array(ids), max_tokens=max_tokens
        ):
            count += 1
            if r.finish_reason != "stop":
                text += r.text
        return text, count

    def mtpkit(self, ids: list[int], max_tokens: int = MAX_TOKENS):
        return generate(self.m, ids, max_tokens=max_tokens, mtp=True)

    def agreed(self, ids: list[int], max_tokens: int = MAX_TOKENS):
        """mtpkit generate's result, checked equal to stock mlx-lm's text first."""
        result = self.mtpkit(ids, max_tokens)
        stock_text, stock_count = self.stock_text(ids, max_tokens)
        assert result.text == stock_text
        assert result.generation_tokens == stock_count
        return result


@pytest.fixture(scope="module")
def refs(converted: Path) -> References:
    return References(converted)


def messages_of(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_mtp(mtp: dict) -> None:
    assert mtp["drafter"] == "mtp"
    assert 1 <= mtp["depth"] <= 3
    assert 0 <= mtp["accepted"] <= mtp["drafted"]
    expected = mtp["accepted"] / mtp["drafted"] if mtp["drafted"] else None
    assert mtp["acceptance"] == expected


def test_chat_completion_is_generate_and_stock_mlx_lm(client, refs) -> None:
    text = heldout(1, skip=0)[0]
    ref = refs.agreed(refs.chat_ids(messages_of(text)))
    served = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=served, messages=messages_of(text), max_tokens=MAX_TOKENS
    )
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.completion_tokens == ref.generation_tokens
    assert r.usage.total_tokens == ref.prompt_tokens + ref.generation_tokens
    mtp = r.model_extra["mtp"]
    check_mtp(mtp)
    # A first request of its prompt decodes as generate does: the same rounds.
    assert (mtp["drafted"], mtp["accepted"]) == (ref.drafted, ref.accepted)
    assert ref.drafted > 0


def test_streamed_chat_with_usage(client, refs) -> None:
    text = heldout(1, skip=1)[0]
    ref = refs.agreed(refs.chat_ids(messages_of(text)))
    stream = client.chat.completions.create(
        model="default_model", messages=messages_of(text), max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == ref.generation_tokens
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    check_mtp(chunks[-1].model_extra["mtp"])


@pytest.mark.parametrize("stream", [False, True])
def test_text_completion_is_generate_and_stock_mlx_lm(client, refs, stream: bool) -> None:
    text = heldout(1, skip=2)[0]
    ref = refs.agreed(refs.text_ids(text))
    if stream:
        chunks = list(client.completions.create(
            model="default_model", prompt=text, max_tokens=MAX_TOKENS, stream=True
        ))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason
        check_mtp(chunks[-1].model_extra["mtp"])
    else:
        r = client.completions.create(model="default_model", prompt=text, max_tokens=MAX_TOKENS)
        assert r.choices[0].text == ref.text
        assert r.usage.prompt_tokens == ref.prompt_tokens
        assert r.usage.completion_tokens == ref.generation_tokens
        check_mtp(r.model_extra["mtp"])


def test_token_id_prompt_and_max_completion_tokens(server, refs) -> None:
    ids = refs.text_ids(heldout(1, skip=3)[0])
    ref = refs.agreed(ids, max_tokens=7)
    body = {"prompt": ids, "max_completion_tokens": 7, "max_tokens": 100}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == ref.text
    assert r.json()["usage"]["completion_tokens"] == 7
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(client, refs, stream: bool) -> None:
    text = heldout(1, skip=4)[0]
    full = refs.mtpkit(refs.text_ids(text)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    assert stop and expected != full
    if stream:
        chunks = list(client.completions.create(
            model="default_model", prompt=text, max_tokens=MAX_TOKENS, stop=[stop, "\x00never"],
            stream=True,
        ))  # fmt: skip
        got = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(
            model="default_model", prompt=text, max_tokens=MAX_TOKENS, stop=stop
        )
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert got == expected
    assert reason == "stop"


def test_second_turn_reuses_the_first_turns_cache(client, refs) -> None:
    first, second = heldout(2, skip=5)
    turn1 = messages_of(first)
    r1 = client.chat.completions.create(model="default_model", messages=turn1, max_tokens=12)
    answer = r1.choices[0].message.content
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": second}]
    ref = refs.agreed(refs.chat_ids(turn2), max_tokens=12)
    r2 = client.chat.completions.create(model="default_model", messages=turn2, max_tokens=12)
    assert r2.choices[0].message.content == ref.text
    assert r2.usage.prompt_tokens == ref.prompt_tokens
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # At least the first turn's prompt was not prefilled again.
    assert cached >= len(refs.chat_ids(turn1)) - 1
    assert cached < r2.usage.prompt_tokens


def test_twenty_concurrent_clients_get_complete_answers(client, refs) -> None:
    prompts = heldout(4, skip=7)
    expected = {p: refs.agreed(refs.text_ids(p), max_tokens=12).text for p in prompts}

    def ask(i: int) -> tuple[str, str]:
        prompt = prompts[i % len(prompts)]
        if i % 2:
            chunks = client.completions.create(
                model="default_model", prompt=prompt, max_tokens=12, stream=True
            )
            return prompt, "".join(c.choices[0].text for c in chunks)
        r = client.completions.create(model="default_model", prompt=prompt, max_tokens=12)
        return prompt, r.choices[0].text

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(ask, range(20)))
    assert len(answers) == 20
    for prompt, text in answers:
        assert text == expected[prompt]


def post(server: ServerProcess, path: str, body: object, key: str | None = API_KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers["Content-Type"] = "application/json"
    return httpx.post(server.url + path, content=content, headers=headers, timeout=TIMEOUT, **kw)


MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/chat/completions", "{not json", 400, None),
    ("/v1/chat/completions", "[1, 2]", 400, None),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": MSG, "model": "other/model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": MSG, "model": "/etc"}, 404, "model"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": MSG, "n": 3}, 400, "n"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes please"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, 400, None),
    ("/v1/completions", {"prompt": [10] * 5000}, 400, None),
    ("/v1/completions", {"prompt": "x" * 30000}, 400, None),
    ("/v1/completions", {"prompt": [10, 10_000_000]}, 400, None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": "maybe"}}, 400, "stream_options.include_usage"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_is_an_openai_error(server, path, body, status, param) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_prompt_longer_than_the_context_names_it(server) -> None:
    r = post(server, "/v1/completions", {"prompt": [10] * 5000})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "context of 4096" in r.json()["error"]["message"]


def test_api_key_is_required_and_health_is_open(server) -> None:
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models", timeout=TIMEOUT).status_code == 401
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json()["status"] == "ok"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_and_method_are_openai_errors(server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.get(server.url + "/v1/nothing", headers=headers, timeout=TIMEOUT)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions", headers=headers, timeout=TIMEOUT)
    assert r.status_code == 405 and "error" in r.json()


def test_models_lists_the_served_model(client, converted: Path) -> None:
    assert [m.id for m in client.models.list().data] == [str(converted)]


def test_the_server_survives_bad_requests(client, refs) -> None:
    """After every refusal above (and a client gone mid-stream), answers are still right."""
    text = heldout(1, skip=0)[0]
    ref = refs.mtpkit(refs.text_ids(text), max_tokens=8)
    r = client.completions.create(model="default_model", prompt=text, max_tokens=8)
    assert r.choices[0].text == ref.text


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_disconnects_cancels_its_decode(server, stream: bool) -> None:
    before = server.wait_idle()["cancelled"]
    body = {"prompt": "def main(argv):", "max_tokens": 3500, "stream": stream}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if stream:
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=TIMEOUT
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # leaving the block closes the connection mid-stream
    else:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while it decodes
            httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=3)
    state = server.wait_idle()
    assert state["cancelled"] == before + 1


def test_a_waiting_client_that_disconnects_frees_its_slot(server) -> None:
    before = server.wait_idle()["cancelled"]
    body = {"prompt": "def main(argv):", "max_tokens": 3500}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.url + "/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "stream": True}, headers=headers, timeout=TIMEOUT
    ) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
        with pytest.raises(httpx.ReadTimeout):  # waits behind the stream, then gives up
            httpx.post(url, json=body, headers=headers, timeout=3)
        assert server.health()["queued"] == 1 or server.health()["cancelled"] > before
    state = server.wait_idle()
    assert state["cancelled"] == before + 2  # the one waiting, then the stream


def test_text_content_parts_are_the_same_prompt(client) -> None:
    text = heldout(1, skip=11)[0]
    half = len(text) // 2
    parts = [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]
    as_parts = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": parts}], max_tokens=8
    )
    as_text = client.chat.completions.create(
        model="default_model", messages=messages_of(text), max_tokens=8
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
