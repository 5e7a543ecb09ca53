"""Fixtures shared across test modules."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.checkpoints import CheckpointFactory, build_checkpoint

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"

# The suite's output is piped: a width from the environment (a terminal's COLUMNS, or the 80
# that pytest-xdist's workers are given) would change how tables lay out. A test that wants
# a width sets it itself.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """`checkpoint(layout, **build_args)`: a tiny checkpoint of `layout` (one of
    `tests.checkpoints.FAMILIES`), built once per distinct call and shared by the session.

    The arguments are `build_checkpoint`'s. Treat the directory as read-only: a test that
    damages a checkpoint works on a copy.
    """
    cache: dict[tuple[Any, ...], Path] = {}

    def build(layout: str, **build_args: Any) -> Path:
        key = (layout, *sorted(build_args.items()))
        if key not in cache:
            cache[key] = build_checkpoint(layout, tmp_path_factory.mktemp(layout), **build_args)
        return cache[key]

    return build


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled trained example converted as stored (bf16, head in mtp/), once per run.

    Tests that damage it work on a copy.
    """
    from mtpkit.convert.pipeline import convert

    out = tmp_path_factory.mktemp("example") / "tiny-qwen3_5-mlx"
    convert(str(EXAMPLE), output=out)
    return out
