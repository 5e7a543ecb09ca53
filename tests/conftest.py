"""Fixtures shared across test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled trained example converted as stored (bf16, head in mtp/), once per run.

    Tests that damage it work on a copy.
    """
    from mtpkit.convert import convert

    out = tmp_path_factory.mktemp("example") / "tiny-qwen3_5-mlx"
    convert(str(EXAMPLE), output=out)
    return out
