"""Tool calls, as mlx_lm.server finds them: the tokenizer's tool parser (mlx-lm infers it
from the chat template, `tokenizer_utils._infer_tool_parser`) marks where a call starts and
ends; the text between the markers is parsed into calls and returned as `tool_calls`, the
rest as the message's content. mlx-lm's own text state machine splits the text, so a
marker split across tokens (or across streamed pieces) is found as mlx_lm.server finds it.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

log = logging.getLogger("mtpkit.serve")


def parses_tools(tokenizer: Any, tools: list[Any] | None) -> bool:
    """Whether a request's output is searched for tool calls: it offers tools and the
    tokenizer has a tool parser (mlx_lm.server warns and answers in text otherwise)."""
    if not tools:
        return False
    if not getattr(tokenizer, "has_tool_calling", False):
        log.warning("the request offers tools but the model's chat template declares no tool calls")
        return False
    return True


class ToolCalls:
    """Splits a response's text, piece by piece, into content and tool calls (OpenAI's
    `tool_calls` entries; streamed ones carry their `index`)."""

    def __init__(self, tokenizer: Any, tools: list[Any], streaming: bool) -> None:
        from mlx_lm.generate import TextStateMachine, make_text_state_machine

        self.machine = TextStateMachine
        self.state = make_text_state_machine(tokenizer).make_state("normal")
        self.parser, self.tools, self.streaming = tokenizer.tool_parser, tools, streaming
        self.tool_text = ""
        self.index = 0
        self.made = False  # a call was made: the finish reason is "tool_calls"

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the complete calls in the next piece of text."""
        self.state, segments = self.machine.split(self.state, text)
        return self._collect(segments, end=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What the text held back at its end (an unfinished call is parsed as it is)."""
        self.state, rest, current = self.machine.flush(self.state)
        return self._collect([(current, rest)], end=True)

    def _collect(
        self, segments: list[tuple[str | None, str]], end: bool
    ) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        for state, text in segments:
            if state == "tool":
                self.tool_text += text
            elif self.tool_text:  # the call ended: back in the text
                calls += self._parse(self.tool_text)
                self.tool_text = ""
            if state == "normal":
                content += text
        if end and self.tool_text:
            calls += self._parse(self.tool_text)
            self.tool_text = ""
        return content, calls

    def _parse(self, text: str) -> list[dict[str, Any]]:
        """OpenAI's entries for one call's text (mlx_lm.server's `ToolCallFormatter`)."""
        self.made = True
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, json.JSONDecodeError) as e:
            log.warning("a tool call could not be parsed (%s: %s)", type(e).__name__, e)
            return []
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            call = dict(call)
            call_id = call.pop("id", None) or f"call_{uuid.uuid4().hex}"
            call["arguments"] = json.dumps(call.get("arguments", {}), ensure_ascii=False)
            entry: dict[str, Any] = {"id": call_id, "type": "function", "function": call}
            if self.streaming:
                entry["index"] = self.index
                self.index += 1
            calls.append(entry)
        return calls


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages as a chat template reads them (mlx_lm.server's
    `process_message_content`): content as text, every other field as sent (`name`,
    `tool_calls`, `tool_call_id`...), a call's JSON `arguments` decoded to an object."""
    out = []
    for message in messages:
        fields = message.model_dump(exclude_unset=True)
        fields["role"], fields["content"] = message.role, message.text()
        for call in fields.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # a template that wants text gets the text
        out.append(fields)
    return out
