"""A request body becomes a decoding `Request`: messages through the chat template (or
mlx_lm.server's plain role prefixes when the tokenizer has none), a text prompt through the
tokenizer as `mtpkit generate --ignore-chat-template` encodes it, token ids as they are;
then the prompt is checked against the model's context and the sampling fields fall back to
the server's defaults."""

from __future__ import annotations

from typing import Any

from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from mtpkit.serve.settings import ServeSettings
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.session import Engine, Request, check_prompt


class BadPrompt(MtpkitError):
    """The messages or prompt cannot be encoded."""


def encode_messages(
    tokenizer: Any, messages: list[ChatMessage], template_args: dict[str, Any]
) -> list[int]:
    """The prompt of a conversation, ending where the assistant's answer begins."""
    from mtpkit.core.prompts import encode_messages as encode_conversation
    from mtpkit.core.templates import ChatTemplateError

    plain = [{"role": m.role, "content": m.text()} for m in messages]
    try:  # the template bounded in time and size; none: mlx_lm.server's rendering
        return encode_conversation(tokenizer, plain, template_args=template_args)
    except ChatTemplateError as e:  # a template's raise_exception (e.g. roles out of order)
        raise BadPrompt(str(e)) from None
    except Exception as e:  # a template that fails otherwise is the request's problem
        raise BadPrompt(f"the chat template refused the messages: {e}") from None


def encode_completion_prompt(tokenizer: Any, prompt: str | list[str] | list[int]) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
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
        prompt = encode_messages(tokenizer, body.messages, args)
    else:
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
        max_tokens=within_context(engine, prompt, body.token_limit(settings.max_tokens)),
        sampling=sampling,
        seed=body.seed,
        stop=body.stop_strings(),
        depth=settings.depth,
        adaptive=settings.adaptive,
    )
