"""Errors a user can fix. The CLI prints their one-line message and exits 1."""

from __future__ import annotations

from collections.abc import Sized


class MtpkitError(Exception):
    """A problem the user can fix; the message names the problem and the fix."""

    exit_code = 1


class SourceNotFound(MtpkitError):
    """No such directory, repo, revision or file."""


class NotACheckpoint(MtpkitError):
    """The source exists but holds no config.json/safetensors checkpoint."""


class UnsupportedFamily(MtpkitError):
    """The config's model_type has no family in the registry."""


class CheckpointProblem(MtpkitError):
    """inspect reported a problem that makes the requested operation unsafe."""


class InvalidConfig(MtpkitError):
    """A config value that decides how the tensors are named is not a usable integer."""


def one_line(error: BaseException) -> str:
    """The message of `Error: ...` for any exception: a user-fixable error's own message, else
    the exception's type and the first line of its text (MTPKIT_DEBUG=1 shows the rest)."""
    if isinstance(error, MtpkitError):
        return str(error)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return f"unexpected {text} (MTPKIT_DEBUG=1 shows where)"


def more_of(items: Sized) -> str:
    """The ' (+N more)' that follows the first of several problems in a one-line message
    (empty for a single one)."""
    return f" (+{len(items) - 1} more)" if len(items) > 1 else ""
