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


# The longest `Error:` line: MLX's load errors list every missing parameter (300,000 lines for
# a header of junk tensors); the head of such a list names the cause.
MAX_MESSAGE = 600


def one_line(error: BaseException) -> str:
    """The message of `Error: ...` for any exception, always one printable line of at most
    about MAX_MESSAGE characters: a user-fixable error's own message (with the lines of a
    library message it quotes joined), else the exception's type and the first line of its
    text (MTPKIT_DEBUG=1 shows the rest, and where)."""
    if isinstance(error, MtpkitError):
        return shortened(str(error))
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return f"unexpected {shortened(text)} (MTPKIT_DEBUG=1 shows where)"


def shortened(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` as one line: its lines joined with spaces, control characters escaped
    (`printable`), and past `limit` characters cut with a count of what was left out."""
    from mtpkit.core.console import printable

    line = printable(" ".join(part.strip() for part in text.splitlines() if part.strip()))
    if len(line) <= limit:
        return line
    return f"{line[:limit]}... (+{len(line) - limit} characters; MTPKIT_DEBUG=1 shows all)"


def more_of(items: Sized) -> str:
    """The ' (+N more)' that follows the first of several problems in a one-line message
    (empty for a single one)."""
    return f" (+{len(items) - 1} more)" if len(items) > 1 else ""
