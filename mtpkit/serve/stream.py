"""A job's events become a response: streamed as server-sent events, or collected into one
body. Both split tool calls from the text (`tools.py`) and attach each token's
log-probabilities (`logprobs.py`) when the request asked for them.

While nothing is decoded yet (a long prompt prefilling, a request waiting its turn) a stream
sends `: keepalive` comments, as mlx_lm.server does, so that a client's read timeout does
not end a request that is on its way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from mtpkit.serve.logprobs import Scored, chat_logprobs, text_logprobs
from mtpkit.serve.metrics import RequestTimer
from mtpkit.serve.schemas import Outcome, ResponseIds, error_body
from mtpkit.serve.tools import ToolCalls, parses_tools
from mtpkit.serve.worker import Failed, Job
from mtpkit.speculative.session import TokenEvent

KEEPALIVE_EVERY = 1.0  # seconds without an event before a stream sends a keepalive comment


class Shaping:
    """What a response adds to the decoded text: tool calls, log-probabilities."""

    def __init__(self, tokenizer: Any, body: Any, chat: bool, streaming: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        tools = (
            getattr(body, "tools", None) if getattr(body, "tool_choice", None) != "none" else None
        )
        self.tools = (
            ToolCalls(tokenizer, tools, streaming)
            if chat and parses_tools(tokenizer, tools)
            else None
        )
        self.logprobs = body.top_tokens() is not None
        self.offset = 0  # characters of text sent (a completion's text_offset)

    def split(self, text: str, end: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """The content and tool calls in the next piece of text (`end`: the last piece)."""
        if self.tools is None:
            return text, []
        content, calls = self.tools.feed(text)
        if end:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        return content, calls

    def scores(self, scored: list[Scored]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, scored)
        shaped = text_logprobs(self.tokenizer, scored, self.offset)
        return shaped

    def finish_reason(self, reason: str) -> str:
        made = self.tools is not None and self.tools.made
        return "tool_calls" if made and reason == "stop" else reason


def scored_of(event: TokenEvent) -> list[Scored]:
    return (
        [(event.token, event.logprob)]
        if event.logprob is not None and event.token is not None
        else []
    )


async def collect(
    job: Job, first: TokenEvent | Outcome, ids: ResponseIds, shaping: Shaping,
    timer: RequestTimer | None = None,
) -> dict[str, Any] | Failed:  # fmt: skip
    """The non-streaming body, once the job has ended (or its failure); `timer` records the
    request's times for /metrics."""
    item: TokenEvent | Outcome | Failed = first
    while not isinstance(item, Outcome):
        if isinstance(item, Failed):
            return item
        if timer is not None:
            timer.token()
        item = await job.events.get()
    if timer is not None:
        timer.token()
        timer.done(item)
    content, calls = shaping.split(item.text, end=True)
    return ids.complete(item, content, calls, shaping.scores(item.scored or []))


async def next_event(job: Job) -> TokenEvent | Outcome | Failed | None:
    """The job's next event, or None after KEEPALIVE_EVERY seconds without one."""
    try:
        return await asyncio.wait_for(job.events.get(), KEEPALIVE_EVERY)
    except asyncio.TimeoutError:
        return None


async def sse(
    job: Job, ids: ResponseIds, first: TokenEvent | Outcome | None, include_usage: bool,
    shaping: Shaping, timer: RequestTimer | None = None,
) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events: keepalive comments until the first text, chunks of text (with
    their tool calls and log-probabilities), the finish chunk (with the mtp object), the
    usage chunk when asked for, `[DONE]`; an error while decoding is an `error` event."""
    try:
        if shaping.chat:
            yield event(ids.role_chunk())
        item = first
        pending: list[Scored] = []  # log-probabilities of tokens whose text is held back
        sent = 0  # tokens whose log-probabilities were sent
        while True:
            if item is None:
                yield ": keepalive\n\n"
            elif isinstance(item, TokenEvent):
                if timer is not None:
                    timer.token()
                pending += scored_of(item)
                content, calls = shaping.split(item.text)
                if content or calls:
                    yield event(ids.chunk(content, None, calls, shaping.scores(pending)))
                    shaping.offset += len(content)
                    sent, pending = sent + len(pending), []
            elif isinstance(item, Outcome):
                if timer is not None:
                    timer.token()
                    timer.done(item)
                content, calls = shaping.split("", end=True)
                pending = (item.scored or [])[sent:]  # held back, and the EOS
                if content or calls or pending:
                    yield event(ids.chunk(content, None, calls, shaping.scores(pending)))
                last = ids.chunk(None, shaping.finish_reason(item.finish_reason))
                last.update(item.extras())  # the mtp object, vLLM's speculative metrics
                yield event(last)
                if include_usage:
                    yield event(ids.usage_chunk(item))
                break
            else:
                kind = "server_error" if item.status >= 500 else "invalid_request_error"
                yield event(error_body(item.message, kind, code=item.code))
                break
            item = await next_event(job)
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client left mid-stream: stop decoding, free the slot (also JobStream)


def event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
