"""Errors a user can fix. The CLI prints their one-line message and exits 1."""

from __future__ import annotations


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
