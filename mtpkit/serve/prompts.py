"""A request body becomes a decoding `Request`: messages through the chat template (or
mlx_lm.server's plain role prefixes when the tokenizer has none), a text prompt through the
tokenizer as `mtpkit generate --ignore-chat-template` encodes it, token ids as they are;
then the prompt is checked against the model's context and the sampling fields fall back to
the server's defaults. A conversation's tools, tool calls, tool results and names go to the
template as mlx_lm.server passes them (`serve/tools.py`)."""

from __future__ import annotations

from typing import Any

from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from mtpkit.serve.settings import ServeSettings
from mtpkit.serve.tools import template_messages
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.logits import LogitsSettings
from mtpkit.speculative.session import Engine, Request, check_prompt


class BadPrompt(MtpkitError):
    """The messages or prompt cannot be encoded."""


def encode_messages(
    tokenizer: Any, messages: list[ChatMessage], template_args: dict[str, Any],
    tools: list[Any] | None = None,
) -> list[int]:  # fmt: skip
    """The prompt of a conversation, ending where the assistant's answer begins."""
    from mtpkit.core.prompts import encode_messages as encode_conversation
    from mtpkit.core.templates import ChatTemplateError

    plain = template_messages(messages)
    try:  # the template bounded in time and size; none: mlx_lm.server's rendering
        return encode_conversation(tokenizer, plain, template_args=template_args, tools=tools)
    except ChatTemplateError as e:  # a template's raise_exception (e.g. roles out of order)
        raise BadPrompt(str(e)) from None
    except Exception as e:  # a template that fails otherwise is the request's problem
        raise BadPrompt(f"the chat template refused the messages: {e}") from None


def encode_completion_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt, chat_template=False)
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else None
    bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise BadPrompt(f"token id {bad[0]} is not in the vocabulary (0..{vocab - 1})")
    return list(prompt)


def within_context(engine: Engine, prompt: list[int], max_tokens: int) -> int:
    """`max_tokens`, or fewer where the prompt and they would pass the model's context:
    decoding then ends at the context with finish_reason "length", rather than refusing a
    request whose answer may well end sooner (OpenAI refuses it; a client's default
    max_tokens would make every long prompt a refusal)."""
    context = engine.m.context_length
    return min(max_tokens, int(context) - len(prompt)) if context else max_tokens


def build_request(
    engine: Engine, body: ChatCompletionRequest | CompletionRequest, settings: ServeSettings
) -> Request:
    """The decoding request for `body` on `engine` (raises a `MtpkitError` for the client)."""
    tokenizer = engine.m.tokenizer
    if isinstance(body, ChatCompletionRequest):
        args = {**settings.chat_template_args, **(body.chat_template_kwargs or {})}
        tools = body.tools if body.tool_choice != "none" else None
        prompt = encode_messages(tokenizer, body.messages, args, tools)
    else:
        if body.tools:
            raise BadPrompt("tools: only chat completions (/v1/chat/completions) take tools")
        prompt = encode_completion_prompt(tokenizer, body.prompt)
    check_prompt(engine.m, prompt)
    sampling = SamplingSettings.checked(
        temp=settings.temp if body.temperature is None else body.temperature,
        top_p=settings.top_p if body.top_p is None else body.top_p,
        top_k=settings.top_k if body.top_k is None else body.top_k,
        min_p=settings.min_p if body.min_p is None else body.min_p,
        vocab_size=engine.m.vocab_size,
    )
    return Request(
        prompt,
        logits=logits_settings(tokenizer, body),
        logprobs=body.top_tokens(),
        max_tokens=within_context(engine, prompt, body.token_limit(settings.max_tokens)),
        sampling=sampling,
        seed=body.seed,
        stop=body.stop_strings(),
        depth=settings.depth,
        adaptive=settings.adaptive,
    )


def logits_settings(
    tokenizer: Any, body: ChatCompletionRequest | CompletionRequest
) -> LogitsSettings:
    """The request's logits processors and XTC; a biased token outside the vocabulary is
    the client's mistake."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    vocab = len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else None
    if vocab is not None and (bad := [t for t in bias if t >= vocab]):
        raise BadPrompt(f"logit_bias: token id {bad[0]} is not in the vocabulary (0..{vocab - 1})")
    return LogitsSettings(
        logit_bias=bias, repetition_penalty=body.repetition_penalty,
        repetition_context_size=body.repetition_context_size,
        presence_penalty=body.presence_penalty, presence_context_size=body.presence_context_size,
        frequency_penalty=body.frequency_penalty,
        frequency_context_size=body.frequency_context_size,
        xtc_probability=body.xtc_probability, xtc_threshold=body.xtc_threshold,
    )  # fmt: skip
