"""How the command line reads numbers and fixed choices: Click's own wording for every usage
error, and no number that is not one.

Typer (0.2x) validates `min=`/`max=` and Enum options with pydantic, whose messages read
`Input should be greater than or equal to 0` and `Value error, '7' is not one of ...`, and it
accepts `nan` as a float, so `--temp nan` was named as a range error. Each numeric or choice
option instead spreads `**ranged(...)` or `**among(...)` into its `typer.Option`: a parser that
raises Click's `BadParameter` with Click's sentences (`'x' is not a valid integer.`, `-1.0 is
not in the range x>=0.`, `'7' is not one of '2', '3'.`), `nan` and `inf` named as such; the
same `min`/`max` still show in --help. Only Typer's public `parser=` is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import Any

import typer

Number = int | float


def ranged(
    kind: type[int] | type[float], *, min: Number | None = None, max: Number | None = None
) -> dict[str, Any]:
    """`typer.Option` keywords for an `int` or `float` option within [min, max]; a float
    must also be finite (`nan`, `inf`: usage errors saying so)."""
    return {"parser": _number_parser(kind, min, max), "min": min, "max": max}


def among(choices: type[Enum]) -> dict[str, Any]:
    """`typer.Option` keywords for an option whose value is one of an Enum's values."""

    def parse(text: Any) -> Enum:
        if isinstance(text, choices):
            return text
        for member in choices:
            if member.value == text:
                return member
        listed = ", ".join(repr(member.value) for member in choices)
        raise typer.BadParameter(f"{text!r} is not one of {listed}.")

    return {"parser": parse}


def describe_range(min: Number | None, max: Number | None) -> str:
    """Click's notation of a range: `x>=0`, `x<=1`, `1<=x<=4`."""
    if min is None:
        return f"x<={max}"
    if max is None:
        return f"x>={min}"
    return f"{min}<=x<={max}"


def _number_parser(
    kind: type[int] | type[float], min: Number | None, max: Number | None
) -> Callable[[Any], Number]:
    name = "integer" if kind is int else "float"

    def parse(text: Any) -> Number:
        if isinstance(text, kind) and not isinstance(text, bool):
            value = text  # a default, already a number
        else:
            try:
                value = kind(str(text).strip())
            except ValueError:
                raise typer.BadParameter(f"{text!r} is not a valid {name}.") from None
        if isinstance(value, float) and math.isnan(value):
            raise typer.BadParameter(f"{text!r} is not a number.")
        if isinstance(value, float) and math.isinf(value):
            raise typer.BadParameter(f"{text!r} is not a finite number.")
        if (min is not None and value < min) or (max is not None and value > max):
            raise typer.BadParameter(f"{value} is not in the range {describe_range(min, max)}.")
        return value

    return parse
