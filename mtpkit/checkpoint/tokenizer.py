"""Loading a model directory's tokenizer as mlx-lm does, never running the repo's code, and
the I/O guard every library load runs under (`library_io`). Below `runtime/` so that
conversion (`mtpkit convert --draft-vocab`) can tokenize with the model's own tokenizer."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtpkit.core.errors import MtpkitError


class RemoteCodeRequired(MtpkitError):
    """The tokenizer exists only as custom code in the repo, which mtpkit never runs."""


class StdinClosed:
    """Standard input while a library loads: reading it is a bug (a question to a user)."""

    def read(self, *args: object) -> str:
        raise MtpkitError("a library tried to read standard input while loading; refused")

    readline = read

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def library_io() -> Iterator[None]:
    """While transformers/mlx-lm load: their prints go to stderr, stdin cannot be read.

    stdout carries only the result (`--json` must parse), and a CI job never waits on a
    question such as transformers' "Do you wish to run the custom code? [y/N]".
    """
    stdin = sys.stdin
    sys.stdin = StdinClosed()  # type: ignore[assignment]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdin = stdin


def load_tokenizer(path: Path, eos_token_ids: Any = None) -> Any:
    """mlx-lm's tokenizer wrapper over transformers' library classes, never remote code.

    `trust_remote_code=False` keeps transformers from asking on stdin when `config.json`
    has an `auto_map` and a `model_type` it does not know (MiMo-7B): the tokenizer's own
    class (`tokenizer_class`, `tokenizer.json`) is used. A tokenizer that exists only as
    custom code is a one-line error.
    """
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    try:
        with library_io():
            return mlx_load_tokenizer(
                path, {"trust_remote_code": False}, eos_token_ids=eos_token_ids
            )
    except ValueError as e:
        if "custom code" not in str(e) and "trust_remote_code" not in str(e):
            raise
        raise RemoteCodeRequired(
            f"the tokenizer of {path} needs custom code from the repo (its auto_map), which "
            "mtpkit never runs: publish a tokenizer.json (a library tokenizer class) with it"
        ) from None
