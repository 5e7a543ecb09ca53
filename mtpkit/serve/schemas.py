"""The OpenAI API's request and response bodies, as pydantic models: a request is validated
here before it reaches the decoding queue (a bad value is a 400 in OpenAI's error shape, see
`app.py`), and a response is built here from a finished session.

Fields the OpenAI API defines that mtpkit does not implement are accepted at their neutral
value and refused otherwise (`n` > 1, `logprobs`, penalties, tools): a client that asks for
them learns so at once instead of getting an answer that silently ignored them.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mtpkit.serve.spec_fields import SpeculativeDecoding

# Roles a chat template receives as they are ("developer" is OpenAI's newer "system").
Role = Literal["system", "developer", "user", "assistant", "tool"]


class TextPart(BaseModel):
    """A part of a message's content; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> TextPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"content parts of type {self.type!r} are not supported: send text")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


class GenerationFields(BaseModel):
    """The fields chat and text completions share; None means the server's default."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[Any] | None = None

    @field_validator("temperature", "top_p", "min_p")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not supported (decoding stays lossless): send 0")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tool calling is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_limit(self, default: int) -> int:
        """max_completion_tokens (OpenAI's newer name) over max_tokens over the default."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return default

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(GenerationFields):
    # A string, one string in a list, or token ids; several prompts per request are not.
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("only one prompt per request is supported")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value


# Responses ------------------------------------------------------------------------------


class Mtp(BaseModel):
    """mtpkit's addition to every response: what drafted and how much of it was kept."""

    drafter: str  # "mtp" (the head), "draft-model", "prompt-lookup" or "none"
    depth: int  # the deepest a round drafted at (0: no drafting)
    drafted: int
    accepted: int
    acceptance: float | None  # accepted / drafted (None: nothing drafted)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prompt cache held (not prefilled again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Outcome(BaseModel):
    """What a finished decode hands to the response builders."""

    text: str
    finish_reason: str
    usage: Usage
    mtp: Mtp
    spec: SpeculativeDecoding | None = None  # where the request was decoded drafting

    def extras(self) -> dict[str, Any]:
        """What rides beside `usage`: the mtp object, and vLLM's per-request
        `metrics.speculative_decoding` where drafting ran."""
        extra: dict[str, Any] = {"mtp": self.mtp.model_dump()}
        if self.spec is not None:
            extra["metrics"] = {"speculative_decoding": self.spec.model_dump()}
        return extra


def _header(kind: str, prefix: str, model: str) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "mtpkit",
    }


class ResponseIds:
    """One response's id, creation time and model, shared by its stream's chunks."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.base = _header("", "chatcmpl" if chat else "cmpl", model)

    def body(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {**self.base, "object": kind, **fields}

    def complete(self, outcome: Outcome) -> dict[str, Any]:
        """The non-streaming response."""
        if self.chat:
            message = {"role": "assistant", "content": outcome.text}
            choice = {"index": 0, "message": message, "finish_reason": outcome.finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason}
            choice["logprobs"] = None
            kind = "text_completion"
        extra = {"usage": outcome.usage.model_dump(), **outcome.extras()}
        return self.body(kind, choices=[choice], **extra)

    def chunk(self, text: str | None, finish_reason: str | None = None) -> dict[str, Any]:
        """One streamed chunk: a text piece, or the last one with the finish reason."""
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            return self.body("chat.completion.chunk", choices=[choice])
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self.body("text_completion", choices=[choice])

    def role_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self.body("chat.completion.chunk", choices=[choice])

    def usage_chunk(self, outcome: Outcome) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, no choices, the usage (and mtp)."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self.body(kind, choices=[], usage=outcome.usage.model_dump(), **outcome.extras())


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def model_list(model_id: str, created: int) -> dict[str, Any]:
    card = {"id": model_id, "object": "model", "created": created, "owned_by": "mtpkit"}
    return {"object": "list", "data": [card]}
