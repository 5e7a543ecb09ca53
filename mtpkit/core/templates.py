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
import signal
import threading
from collections.abc import Iterator
from datetime import datetime
from types import FrameType
from typing import Any

from mtpkit.core.errors import MtpkitError

# A rendered prompt, or any string or list a template builds, holds at most this many items
# beyond the messages' own length (a long prompt stays allowed: see `_limit`).
MAX_CHARS = 1_000_000
# Seconds a render may take: real templates take milliseconds.
MAX_SECONDS = 10.0
# The largest exponent `**` computes (10 ** 4096 already has 4,097 digits).
MAX_EXPONENT = 4096


FIX = (
    "fix chat_template in the model's tokenizer files, or pass --no-chat-template where the "
    "command takes it"
)


class ChatTemplateError(MtpkitError):
    """A chat template that raised, or ran past its bounds."""


class _Overrun(Exception):
    """Raised inside a render that broke a bound (caught and named by `apply_chat_template`)."""


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """`tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)`, bounded: the
    template is rendered in the bounded sandbox first; a template that raises or overruns is a
    `ChatTemplateError`."""
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
    except Exception as e:  # jinja2.TemplateError: the template's raise_exception, or a fault
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        raise ChatTemplateError(
            f"the tokenizer's chat template refused the prompt ({type(e).__name__}: {e}); {FIX}"
        ) from None


def _template_text(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers uses "default"
        template = template.get("default")
    return template if isinstance(template, str) else None


def _limit(messages: list[dict[str, Any]]) -> int:
    """MAX_CHARS beyond a few times the messages' own length, so a long prompt still fits."""
    return MAX_CHARS + 4 * sum(len(str(m.get("content", ""))) for m in messages)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise `_Overrun` in the main thread after `seconds` (SIGALRM); elsewhere, where Python
    runs no signal handler, the size bounds alone apply."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise _Overrun(f"ran longer than {seconds:g} seconds")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
        "add_generation_prompt": kwargs.get("add_generation_prompt", False),
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
