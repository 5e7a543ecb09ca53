"""The OpenAI API's request and response bodies, as pydantic models: a request is validated
here before it reaches the decoding queue (a bad value is a 400 in OpenAI's error shape, see
`app.py`), and a response is built here from a finished session.

The fields mlx_lm.server honours are honoured (tools, logprobs, penalties, logit bias, XTC).
Fields the OpenAI API defines that mtpkit does not implement are accepted at their neutral
value and refused otherwise (`n` > 1, and the table of `refusals.py`: `best_of`,
`response_format`, the legacy `functions`, ...): a client that asks for them learns so at once
instead of getting an answer that silently ignored them.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mtpkit.serve.refusals import refuse_unhonoured
from mtpkit.serve.spec_fields import SpeculativeDecoding

# Roles a chat template receives as they are ("developer" is OpenAI's newer "system").
Role = Literal["system", "developer", "user", "assistant", "tool"]


def _part_problem(part: Any) -> str | None:
    """Why a content part cannot be read (None: a text part)."""
    if not isinstance(part, dict):
        return 'a content part must be an object such as {"type": "text", "text": "..."}'
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return None
    if kind in ("image_url", "input_image", "image", "input_audio", "file"):
        return f"this server reads text only: {kind!r} content parts cannot be sent to this model"
    return f"a content part of type {kind!r} is not supported: send text parts or a string"


class ChatMessage(BaseModel):
    """A message as the chat template reads it: `name`, `tool_calls` (an assistant's
    calls) and `tool_call_id` (a tool's result) pass to the template with the content."""

    model_config = ConfigDict(extra="allow")
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _readable(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if (problem := _part_problem(part)) is not None:
                    raise ValueError(problem)
        elif value is not None and not isinstance(value, str):
            raise ValueError("the content must be a string or a list of text parts")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
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
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # MLX's random key takes 64 bits
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # Honoured as mlx_lm.server honours them (its names, defaults and ranges).
    logprobs: bool | int | None = None  # chat: a bool; completions: also the legacy top-n
    top_logprobs: int | None = Field(None, ge=0, le=20)
    repetition_penalty: float = Field(0.0, ge=0.0)
    repetition_context_size: int = Field(20, ge=0)
    presence_penalty: float = 0.0
    presence_context_size: int = Field(20, ge=0)
    frequency_penalty: float = 0.0
    frequency_context_size: int = Field(20, ge=0)
    logit_bias: dict[str, float] | None = None
    xtc_probability: float = Field(0.0, ge=0.0, le=1.0)
    xtc_threshold: float = Field(0.1, ge=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None  # OpenAI's end-user id: nothing to decode differently
    # Fields mtpkit cannot honour are refused by `refusals.REFUSED` (a 400 naming each).

    @model_validator(mode="before")
    @classmethod
    def _honoured(cls, data: Any) -> Any:
        refuse_unhonoured(data)  # the fields in refusals.REFUSED, and lone surrogates
        return data

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
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
    def _logprobs(cls, value: bool | int | None) -> bool | int | None:
        if not isinstance(value, bool) and isinstance(value, int) and not 0 <= value <= 20:
            raise ValueError("must be true, false or (completions) a number of top tokens, 0-20")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().isdigit():
                raise ValueError(f"keys are token ids (integers), not {key!r}")
            if not math.isfinite(bias):
                raise ValueError(f"the bias of token {key} must be a finite number")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value not in (None, "auto", "none"):
            raise ValueError(
                "only 'auto' and 'none' are supported: this server cannot force the model to "
                "call a tool"
            )
        return value

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel(cls, value: bool | None) -> bool | None:
        if value is False:
            raise ValueError("false is not supported: every call the model makes is returned")
        return value

    def top_tokens(self) -> int | None:
        """None: no log-probabilities; n: each token's, with the top n (mlx_lm.server's
        `logprobs` and `top_logprobs`; a completion's `logprobs: n` is OpenAI's legacy form)."""
        top = self.top_logprobs or 0
        if not isinstance(self.logprobs, bool) and isinstance(self.logprobs, int):
            top = max(top, self.logprobs)
            return top
        return top if self.logprobs or top > 0 else None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value == "" or isinstance(value, list) and any(not s for s in value):
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
    # A string or token ids, alone or as the one prompt in a list (lm-eval sends [[ids]]);
    # several prompts per request are not supported.
    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(
                    f"only one prompt per request is supported, not {len(value)}: send them "
                    "one request each"
                )
            value = value[0]
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise ValueError("must be a string or a list of token ids (integers)")
        if not value:
            raise ValueError("the prompt is empty")
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
    # SYNTHETIC (`--oracle-acceptance`): the oracle's share its drafts were right at, where
    # they were the oracle's (None: the drafter's own).
    synthetic_acceptance: float | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prompt cache held (not prefilled again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Outcome(BaseModel):
    """What a finished decode hands to the response builders; `scored`: with logprobs
    asked for, (token id, `TokenLogprob`) of every completion token, the EOS included (as
    mlx_lm.server reports them)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    text: str
    finish_reason: str
    usage: Usage
    mtp: Mtp
    scored: list[Any] | None = None
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

    def complete(
        self, outcome: Outcome, content: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None, logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The non-streaming response; `content` (default: the outcome's text) is the text
        without its tool calls."""
        text = outcome.text if content is None else content
        reason = "tool_calls" if tool_calls and outcome.finish_reason == "stop" else None
        reason = reason or outcome.finish_reason
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["content"] = text or None
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "finish_reason": reason}
            choice["logprobs"] = logprobs
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
            kind = "text_completion"
        extra = {"usage": outcome.usage.model_dump(), **outcome.extras()}
        return self.body(kind, choices=[choice], **extra)

    def chunk(
        self, text: str | None, finish_reason: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None, logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One streamed chunk: a text piece (and the tool calls and log-probabilities that
        came with it), or the last one with the finish reason."""
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
            if logprobs is not None:
                choice["logprobs"] = logprobs
            return self.body("chat.completion.chunk", choices=[choice])
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason}
        choice["logprobs"] = logprobs
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


def model_card(model_id: str, created: int) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mtpkit"}


def model_list(model_id: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model_id, created)]}
