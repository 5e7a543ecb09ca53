"""Tools through `mtpkit serve` as agents use them, against `mlx_lm.server` on the same
directory: a conversation with tool calls, tool results and names renders the same prompt
(the same prompt token count, the same answer); a call the model makes comes back as
`tool_calls` (streamed too) as mlx_lm.server returns it; and one LangChain `bind_tools`
round trip (call, result, answer) gets the same messages from both servers.

The model is the example with a tool-rendering template whose answer token is renamed to a
whole tool call (`tests/serve_clients.py`): greedy, it calls `get_weather(city="Paris")`.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.mlx_lm_server import MlxLmServer
from tests.serve_clients import WEATHER, calling_model
from tests.serve_process import ServerProcess

TIMEOUT = 300.0
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "Answer briefly"},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21C"},
    {"role": "user", "name": "ada", "content": "And tomorrow?"},
]  # fmt: skip


@pytest.fixture(scope="module")
def servers(converted: Path, tmp_path_factory: pytest.TempPathFactory):
    where = tmp_path_factory.mktemp("tools")
    model = calling_model(converted, where / "model")
    ours = ServerProcess(model, where / "mtpkit.log")
    try:
        theirs = MlxLmServer(model, where / "mlx_lm.log")
    except Exception:
        ours.stop()
        raise
    yield ours, theirs
    ours.stop()
    theirs.stop()


def clients(servers) -> tuple[openai.OpenAI, openai.OpenAI]:
    return tuple(
        openai.OpenAI(base_url=s.url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
        for s in servers
    )


def test_tool_history_renders_the_prompt_mlx_lm_server_renders(servers) -> None:
    ours, theirs = clients(servers)
    counts, answers = [], []
    for client in (ours, theirs):
        r = client.chat.completions.create(
            model="default_model", messages=HISTORY, tools=[WEATHER], max_tokens=8
        )
        counts.append(r.usage.prompt_tokens)
        answers.append(r.choices[0].message.model_dump(include={"content", "tool_calls"}))
    assert counts[0] == counts[1]
    # The tool turns, the result's id and the name are in it (issue 47: 36 tokens against 70).
    plain = [
        {"role": m["role"], "content": m["content"] or ""} for m in HISTORY if m["role"] != "tool"
    ]
    bare = ours.chat.completions.create(model="default_model", messages=plain, max_tokens=1)
    assert counts[0] > bare.usage.prompt_tokens + 20
    for answer in answers:  # ids are fresh per response
        for call in answer["tool_calls"] or []:
            call["id"] = None
    assert answers[0] == answers[1]


def test_a_tool_call_comes_back_as_mlx_lm_servers(servers) -> None:
    ours, theirs = clients(servers)
    results = [
        c.chat.completions.create(model="default_model", messages=ASK, tools=[WEATHER], max_tokens=8)
        for c in (ours, theirs)
    ]  # fmt: skip
    calls = []
    for r in results:
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls.append(
            [
                (c.type, c.function.name, json.loads(c.function.arguments))
                for c in choice.message.tool_calls
            ]
        )
        assert all(c.id for c in choice.message.tool_calls)
    assert calls[0] == calls[1] == [("function", "get_weather", {"city": "Paris"})]
    assert results[0].usage.prompt_tokens == results[1].usage.prompt_tokens
    # Streamed: the call arrives whole, with its index, and the stream ends with tool_calls.
    stream = ours.chat.completions.create(
        model="default_model", messages=ASK, tools=[WEATHER], max_tokens=8, stream=True
    )
    chunks = list(stream)
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools in the request the text is the model's own, unparsed.
    text = ours.chat.completions.create(model="default_model", messages=ASK, max_tokens=8)
    assert "<tool_call>" in text.choices[0].message.content


def test_tool_choice_the_server_cannot_honour_is_refused(servers) -> None:
    ours = servers[0]
    for field, value in (("tool_choice", "required"), ("parallel_tool_calls", False)):
        body = {"messages": ASK, "tools": [WEATHER], field: value}
        r = httpx.post(ours.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 8}
    r = httpx.post(ours.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert "tool_calls" not in r["choices"][0]["message"]  # no tools offered: none called


def test_langchain_bind_tools_round_trip(servers) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city"""
        return "sunny, 21C"

    transcripts = []
    for server in servers:
        llm = ChatOpenAI(
            base_url=server.url + "/v1", api_key="none", model="default_model", max_tokens=8,
            temperature=0, timeout=TIMEOUT, max_retries=0,
        ).bind_tools([get_weather])  # fmt: skip
        messages = [HumanMessage("What is the weather in Paris?")]
        called = llm.invoke(messages)
        assert [(c["name"], c["args"]) for c in called.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        result = get_weather.invoke(called.tool_calls[0]["args"])
        assert called.tool_calls[0]["id"]
        # Each server makes its own random id, which the template renders: the same one here.
        called.tool_calls[0]["id"] = "call_1"
        messages += [called, ToolMessage(result, tool_call_id="call_1")]
        answer = llm.invoke(messages)
        transcripts.append(
            (answer.content, [(c["name"], c["args"]) for c in answer.tool_calls],
             answer.usage_metadata["input_tokens"])
        )  # fmt: skip
    assert transcripts[0] == transcripts[1]
