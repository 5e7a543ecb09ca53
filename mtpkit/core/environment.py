"""The environment variables mtpkit and the libraries under it read, checked in one place
before a command loads anything: a bad value is one line naming the variable and the fix,
never an `unexpected` error from deep inside huggingface_hub or MLX.

- Numbers: MTPKIT_THREADS (worker threads), HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT
  (seconds per Hub request; huggingface_hub reads them as whole numbers when imported),
  MTPKIT_HUB_TIMEOUT (seconds an upload's request may wait for each step).
- Switches: MTPKIT_KERNELS, MTPKIT_QMV, MTPKIT_GDN_PLAIN, MTPKIT_CONV_OPS, HF_HUB_OFFLINE, HF_HUB_DISABLE_PROGRESS_BARS
  (1/0, true/false, yes/no, on/off, as huggingface_hub spells them).
- URLs: HF_ENDPOINT (the Hub's address) must be an http:// or https:// URL with a host.
- Directories: MTPKIT_CACHE (check's converted copies) and TMPDIR (scratch space: MLX and
  `tempfile` fail without it) must be directories, or for MTPKIT_CACHE creatable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from mtpkit.core.errors import MtpkitError

WHOLE_SECONDS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT", "MTPKIT_HUB_TIMEOUT")
COUNTS = ("MTPKIT_THREADS",)
SWITCHES = (
    "MTPKIT_KERNELS",
    "MTPKIT_QMV",
    "MTPKIT_GDN_PLAIN",
    "MTPKIT_CONV_OPS",
    "HF_HUB_OFFLINE",
    "HF_HUB_DISABLE_PROGRESS_BARS",
)
SWITCH_WORDS = {"", "0", "1", "true", "false", "yes", "no", "on", "off"}


class EnvironmentProblem(MtpkitError):
    """An environment variable holds a value that cannot work."""


def check_environment(env: Mapping[str, str] | None = None) -> None:
    """Raise `EnvironmentProblem` for the first variable whose value cannot work."""
    env = os.environ if env is None else env
    for name in (*WHOLE_SECONDS, *COUNTS):
        value = env.get(name)
        if value is not None and value.strip() and not _positive_int(value):
            unit = "seconds" if name in WHOLE_SECONDS else "threads"
            raise EnvironmentProblem(
                f"{name}={value!r} is not a positive whole number of {unit}: set it to e.g. "
                f"{10 if name in WHOLE_SECONDS else 4}, or unset it"
            )
    for name in SWITCHES:
        value = env.get(name)
        if value is not None and value.strip().lower() not in SWITCH_WORDS:
            raise EnvironmentProblem(
                f"{name}={value!r} is not a switch: set it to 1 or 0 (true/false), or unset it"
            )
    endpoint = env.get("HF_ENDPOINT", "").strip()
    if endpoint:
        parsed = urlparse(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise EnvironmentProblem(
                f"HF_ENDPOINT={env['HF_ENDPOINT']!r} is not an http:// or https:// URL: set it "
                "to e.g. https://huggingface.co, or unset it"
            )
    _check_directory(env, "TMPDIR", create=False)
    _check_directory(env, "MTPKIT_CACHE", create=True)


def switch(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    """A switch's value: True (1/true/yes/on), False (0/false/no/off), None (unset or empty)."""
    value = (os.environ if env is None else env).get(name, "").strip().lower()
    if not value:
        return None
    return value in {"1", "true", "yes", "on"}


def _positive_int(value: str) -> bool:
    try:
        return int(value.strip()) > 0
    except ValueError:
        return False


def _check_directory(env: Mapping[str, str], name: str, *, create: bool) -> None:
    value = env.get(name)
    if not value:
        return
    path = Path(value).expanduser()
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise EnvironmentProblem(
                f"{name}={value} is not writable: point it at a directory you can write, or "
                "unset it"
            )
        return
    if path.exists():
        raise EnvironmentProblem(
            f"{name}={value} is a file, not a directory: point it at a directory, or unset it"
        )
    parent = next((p for p in path.parents if p.exists()), None)
    if not create or parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise EnvironmentProblem(
            f"{name}={value} does not exist{'' if not create else ' and cannot be created'}: "
            "point it at a directory, or unset it"
        )
