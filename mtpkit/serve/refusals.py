"""Request fields the server cannot honour, refused by name, and text it cannot carry.

OpenAI's API (and mlx_lm.server's) defines fields mtpkit does not implement. Ignored, each
would be an answer that silently differs from what the client asked for; so a field in
REFUSED that a request sets to anything but its neutral value is a 400 naming it. The table
is the one place to shrink when a field becomes honoured (give it a real field in
`schemas.py` and delete its row). Unknown fields outside the table are ignored, as OpenAI's
own clients send some that change nothing (`user`, `metadata`, `store`).

A lone surrogate (JSON's `"\\ud800"`) decodes to a Python string that no tokenizer, log or
response can encode; it is refused where it enters, naming where it was found.
"""

from __future__ import annotations

from typing import Any


def _unset(value: Any) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _zero(value: Any) -> bool:
    return _unset(value) or value == 0


def _one(value: Any) -> bool:
    return value is None or value == 1


def _text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


# field -> (is its value neutral?, what to tell the client)
REFUSED: dict[str, tuple[Any, str]] = {
    "response_format": (
        _text_format, "structured output (json_object, json_schema) is not supported"
    ),
    "best_of": (_one, "best_of is not supported (one choice per request)"),
    "functions": (_unset, "the legacy functions API is not supported: send `tools`"),
    "function_call": (_unset, "the legacy functions API is not supported: send `tools`"),
    "logits_processors": (_unset, "logits processors are not supported"),
    "prediction": (_unset, "predicted outputs (prediction) are not supported"),
    "audio": (_unset, "audio output is not supported"),
    "modalities": (lambda v: _unset(v) or v == ["text"], "only the text modality is supported"),
    "num_draft_tokens": (_unset, "num_draft_tokens is mlx_lm.server's: mtpkit drafts adaptively"),
    "adapters": (_unset, "adapters are not supported"),
    "draft_model": (_unset, "a request cannot choose the drafter: it is the server's"),
}


class Refused(ValueError):
    """A field the server cannot honour, or text it cannot carry (`param` names where)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def refuse_unhonoured(body: Any) -> None:
    """Raise `Refused` for the first field of REFUSED that `body` (a request's JSON object)
    sets to a non-neutral value, or for the first string holding a lone surrogate."""
    if not isinstance(body, dict):
        return
    for name, (neutral, message) in REFUSED.items():
        if name in body and not neutral(body[name]):
            raise Refused(name, message)
    where = _surrogate(body, ())
    if where is not None:
        param = ".".join(where) or "body"
        raise Refused(param, "holds a lone surrogate (invalid Unicode): send UTF-8 text")


def _surrogate(value: Any, path: tuple[str, ...]) -> tuple[str, ...] | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items: Any = ()
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    for key, item in items:
        if isinstance(key, str) and _surrogate(key, path) is not None:
            return path
        found = _surrogate(item, (*path, str(key)))
        if found is not None:
            return found
    return None
