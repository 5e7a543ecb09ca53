"""A chat template is data from a checkpoint, and runs bounded in time and size.

transformers renders a tokenizer's chat template in Jinja's sandbox, which stops a template
from reaching Python but not from looping for hours (two nested `range(100000)`) or building a
3 GB string (`{{ 'A' * 3000000000 }}`). Every chat template mtpkit applies (generate, check,
bench, train-head: `apply_chat_template` below) is first rendered here, with the same messages
and special tokens, in a sandbox whose `*`, `**` and padding filters refuse results past
MAX_CHARS (Jinja's sandbox already caps each `range` at 100,000), whose output stops at
MAX_CHARS, and which ends after MAX_SECONDS; only then does transformers render it (the same
work, now known to be bounded) and tokenize the result. A template that raises
(`raise_exception`) or breaks a bound is one `Error:` line naming the model's template.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from types import FrameType
from typing import Any

from mtpkit.core.console import printable
from mtpkit.core.errors import MtpkitError

# A rendered prompt, or any string or list a template builds, holds at most this many items
# beyond the messages' own length (a long prompt stays allowed: see `_limit`).
MAX_CHARS = 1_000_000
# Seconds a render may take: real templates take milliseconds.
MAX_SECONDS = 10.0
# The largest exponent `**` computes (10 ** 4096 already has 4,097 digits).
MAX_EXPONENT = 4096


# The file name Jinja gives a template compiled from a string (`Environment.from_string`).
TEMPLATE_FILE = "<template>"
# `tokenizer.apply_chat_template`'s own parameters: never template variables.
CALL_PARAMETERS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "processor_kwargs",
})  # fmt: skip

FIX = (
    "fix chat_template in the model's tokenizer files (or the template given to the command), "
    "or pass --no-chat-template where the command takes it"
)


class ChatTemplateError(MtpkitError):
    """A chat template that raised, or ran past its bounds."""


class _Overrun(Exception):
    """Raised inside a render that broke a bound (caught and named by `apply_chat_template`)."""


def apply_chat_template(
    tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
    **kwargs: Any,
) -> list[int]:  # fmt: skip
    """`tokenizer.apply_chat_template(messages, tokenize=True, tools=tools, **kwargs)`,
    bounded: the template is rendered in the bounded sandbox first; a template that raises or
    overruns is a `ChatTemplateError`. `kwargs` are template variables (`template_variables`);
    `tools` (a request's own field, never a template argument) the tool definitions."""
    kwargs = template_variables(kwargs)
    if tools:
        kwargs = {**kwargs, "tools": tools}
    template = _template_text(tokenizer)
    limit = _limit(messages)
    try:
        if template is not None:
            # Only the render is timed: tokenizing a long prompt may take its time.
            with _time_limit(MAX_SECONDS):
                _trial_render(template, tokenizer, messages, limit, kwargs)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        if hasattr(ids, "keys"):  # a BatchEncoding (transformers 5 may return one)
            ids = ids["input_ids"]
        return list(ids)
    except _Overrun as e:
        raise ChatTemplateError(
            f"the tokenizer's chat template {e}: it is not run further; {FIX}"
        ) from None
    except RecursionError:  # a macro calling itself without end
        raise ChatTemplateError(
            f"the tokenizer's chat template recurses without end: it is not run further; {FIX}"
        ) from None
    except Exception as e:  # jinja2.TemplateError: the template's raise_exception, or a fault
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        raise ChatTemplateError(
            f"the tokenizer's chat template refused the prompt ({type(e).__name__}: {e}); {FIX}"
        ) from None


def template_variables(args: dict[str, Any]) -> dict[str, Any]:
    """`args` when each is a variable for the template (e.g. `enable_thinking`); a
    ChatTemplateError names the first that is not: one of `tokenizer.apply_chat_template`'s
    own parameters (`chat_template` would replace the template, `tools` bypass a refusal,
    `return_tensors` change what comes back) or a name no template can read."""
    for name in args:
        if name in CALL_PARAMETERS:
            raise ChatTemplateError(
                f"chat template argument `{name}` is not a template variable (it is a "
                "parameter of the tokenizer's apply_chat_template): leave it out"
            )
        if not isinstance(name, str) or not name.isidentifier():
            raise ChatTemplateError(
                f"chat template argument {printable(repr(name))[:80]} is not a variable name"
            )
    return args


def check_template(template: str, origin: str) -> None:
    """Raise a ChatTemplateError naming `origin` (e.g. "--chat-template") when `template`
    is not a Jinja template (checked once, where it is given, not at the first request)."""
    if not isinstance(template, str):
        raise ChatTemplateError(f"{origin} must be text (a Jinja template), not {type(template).__name__}")
    from jinja2.exceptions import TemplateError

    try:
        _bounded_environment(MAX_CHARS).parse(template)
    except TemplateError as e:
        raise ChatTemplateError(
            f"{origin} is not a valid Jinja template ({type(e).__name__}: {printable(str(e))})"
        ) from None


def _template_text(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers uses "default"
        template = template.get("default")
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(
            f"the tokenizer's chat template is {type(template).__name__}, not text; {FIX}"
        )
    return template


def _limit(messages: list[dict[str, Any]]) -> int:
    """MAX_CHARS beyond a few times the messages' own length, so a long prompt still fits."""
    return MAX_CHARS + 4 * sum(len(str(m.get("content", ""))) for m in messages)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise `_Overrun` once the template has run `seconds`, in whichever thread renders it
    (the server renders off the main thread, where SIGALRM cannot reach): the thread's trace
    function watches only the template's own compiled code (Jinja names it `<template>`) and
    checks the clock at each of its lines, so each loop turn, macro call and output piece
    passes a check. A single builtin step is bounded by the sandbox's size limits instead.
    A render in a subprocess would also bound memory, but costs a process per prompt and a
    copy of the tokenizer's special tokens; this costs nothing outside the template."""
    deadline = time.monotonic() + seconds

    def line(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _Overrun(f"ran longer than {seconds:g} seconds")
        return line

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(call)
    try:
        yield
    finally:
        sys.settrace(previous)


def _trial_render(
    template: str,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    limit: int,
    kwargs: dict[str, Any],
) -> None:
    """Render `template` as transformers would (its globals, filters and variables), in a
    sandbox that refuses oversized values and output."""
    env = _bounded_environment(limit)
    compiled = env.from_string(template)
    variables = {
        **dict(getattr(tokenizer, "special_tokens_map", {}) or {}),
        "messages": messages,
        "tools": kwargs.get("tools"),
        "documents": None,
        **kwargs,
    }
    produced = 0
    for piece in compiled.generate(**variables):
        produced += len(piece)
        if produced > limit:
            raise _Overrun(f"writes more than {limit:,} characters")


def _bounded_environment(limit: int) -> Any:
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """transformers' `{% generation %}` block (assistant masks), rendered as its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                if isinstance(right, int) and abs(right) > MAX_EXPONENT and abs(left) > 1:
                    raise _Overrun(f"computes a power with exponent {right}")
                return super().call_binop(context, operator, left, right)
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    if len(seq) * times > limit:
                        raise _Overrun(f"builds a value of {len(seq) * times:,} items")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def padded(name: str) -> Any:
        original = env.filters[name]

        def bounded(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> Any:
            if isinstance(width, int) and width > limit:
                raise _Overrun(f"pads to {width:,} characters")
            return original(value, width, *args, **kwargs)

        return bounded

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    for name in ("center", "indent"):
        env.filters[name] = padded(name)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
