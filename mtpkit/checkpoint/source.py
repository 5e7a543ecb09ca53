"""Where a checkpoint lives: a local directory or a Hugging Face Hub repo.

Both kinds answer the same few questions (which files, their sizes, a small JSON file, a
byte range, a whole file on disk) so that nothing downstream cares where bytes come from.
The Hub side is the real `huggingface_hub` client; ranged reads go through its HTTP session
so that inspecting a repo costs a few kilobytes per shard, never a shard.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

from mtpkit.core.config import load_json
from mtpkit.core.errors import MtpkitError, NotACheckpoint, SourceNotFound

# What the Hub accepts as a repo id (ASCII only: `huggingface_hub.utils.validate_repo_id`),
# one-part ids such as `gpt2` included, as mlx-lm and huggingface_hub take them.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$", re.ASCII)


def is_safe_relpath(name: str) -> bool:
    """True for a plain relative path that stays inside the repo (no `..`, no absolute)."""
    if not name or "\\" in name or name.startswith("/") or ":" in name.split("/")[0]:
        return False
    parts = PurePosixPath(name).parts
    return all(p not in ("..", ".", "") for p in parts)


@dataclass
class Source:
    """A checkpoint's files. Subclasses implement the I/O."""

    spec: str
    revision: str | None = None
    commit: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes

    kind = "local"

    def has(self, name: str) -> bool:
        return name in self.files

    def read_bytes_range(self, name: str, start: int, length: int) -> bytes:
        raise NotImplementedError

    def local_file(self, name: str) -> Path:
        """The whole file on local disk (downloaded and cached for the Hub)."""
        raise NotImplementedError

    def snapshot_dir(self) -> Path:
        """Every file on local disk, in one directory (for the Hub: a full download, cached)."""
        raise NotImplementedError

    def read_json(self, name: str) -> Any:
        """A small JSON file, or None when the source lacks it."""
        if not self.has(name):
            return None
        try:
            return load_json(
                self.local_file(name).read_text(encoding="utf-8"), f"{name} in {self.describe()}"
            )
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NotACheckpoint(f"{name} in {self.describe()} is not valid JSON: {e}") from None

    def describe(self) -> str:
        return self.spec if self.revision is None else f"{self.spec}@{self.revision}"


class LocalSource(Source):
    kind = "local"

    def __init__(self, path: Path) -> None:
        root = path.resolve()
        files = {}
        for p in sorted(root.rglob("*")):
            if p.is_file() and ".cache" not in p.relative_to(root).parts:
                files[p.relative_to(root).as_posix()] = p.stat().st_size
        super().__init__(spec=str(path), files=files)
        self.root = root

    def local_file(self, name: str) -> Path:
        if not is_safe_relpath(name):
            raise MtpkitError(f"refusing to open {name!r}: it points outside {self.root}")
        return self.root / name

    def snapshot_dir(self) -> Path:
        return self.root

    def read_bytes_range(self, name: str, start: int, length: int) -> bytes:
        with open(self.local_file(name), "rb") as f:
            f.seek(start)
            return f.read(length)


class HubSource(Source):
    kind = "hub"

    def __init__(self, repo_id: str, revision: str | None) -> None:
        from huggingface_hub import HfApi

        with hub_errors(repo_id, revision):
            info = HfApi().model_info(
                repo_id, revision=revision, files_metadata=True, timeout=hub_timeouts()[0]
            )
        files = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
        super().__init__(spec=repo_id, revision=revision, commit=info.sha, files=files)
        self.repo_id = repo_id

    def local_file(self, name: str) -> Path:
        from huggingface_hub import hf_hub_download

        with hub_errors(self.repo_id, self.revision, name), hub_progress():
            return Path(
                hf_hub_download(
                    self.repo_id,
                    name,
                    revision=self.commit or self.revision,
                    etag_timeout=hub_timeouts()[0],
                )
            )

    def snapshot_dir(self) -> Path:
        """The repo at its resolved commit in the Hugging Face cache, the one all commands share."""
        return self.download()

    def download(self, patterns: Iterable[str] | None = None) -> Path:
        """The repo's files (those matching `patterns`, default all) in the Hugging Face cache,
        one bounded request at a time (snapshot_download's listing call has no timeout);
        returns the snapshot folder."""
        wanted = [
            n
            for n in sorted(self.files)
            if patterns is None or any(fnmatch(n, p) for p in patterns)
        ]
        if "config.json" not in self.files:  # a dataset, a code repo, an empty one
            raise no_config(self)
        if "config.json" not in wanted:
            wanted.insert(0, "config.json")
        paths = [self.local_file(name) for name in wanted]
        return paths[0].parents[len(PurePosixPath(wanted[0]).parts) - 1]

    def read_bytes_range(self, name: str, start: int, length: int) -> bytes:
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

        if length <= 0:
            return b""
        url = hf_hub_url(self.repo_id, name, revision=self.commit or self.revision)
        headers = build_hf_headers()
        headers["Range"] = f"bytes={start}-{start + length - 1}"
        with hub_errors(self.repo_id, self.revision, name):
            response = get_session().get(
                url, headers=headers, follow_redirects=True, timeout=hub_timeouts()[1]
            )
            hf_raise_for_status(response)
        body = response.content
        if response.status_code == 200:  # server ignored Range: keep only what was asked
            body = body[start : start + length]
        return body


def no_config(source: Source) -> NotACheckpoint:
    """What every command says of a source without config.json (inspect, check, generate,
    bench and train-head alike)."""
    return NotACheckpoint(
        f"{source.describe()} has no config.json: not a model checkpoint "
        "(pass the folder that holds config.json and the safetensors files)"
    )


class hub_errors:
    """Turn the client's exceptions into one-line errors that say what to do."""

    def __init__(self, repo_id: str, revision: str | None, filename: str | None = None):
        self.repo_id, self.revision, self.filename = repo_id, revision, filename

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where = self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        if _timed_out(exc):
            etag, download = hub_timeouts()
            raise SourceNotFound(
                f"cannot reach the Hub at {endpoint} for {where}: no answer within "
                f"{etag:g}s (HF_HUB_ETAG_TIMEOUT) or {download:g}s (HF_HUB_DOWNLOAD_TIMEOUT) and "
                "it is not cached: check the network, raise those limits, or pass a local "
                "directory"
            ) from None
        if isinstance(exc, GatedRepoError):
            raise SourceNotFound(
                f"{self.repo_id} is gated: accept its terms on the Hub and log in (hf auth login)"
            ) from None
        if isinstance(exc, RepositoryNotFoundError):
            raise SourceNotFound(
                f"no Hub repo {self.repo_id} (or it is private): check the id, or pass a "
                "local directory"
            ) from None
        if isinstance(exc, RevisionNotFoundError):
            raise SourceNotFound(
                f"revision {self.revision!r} not found in {self.repo_id}: check --revision"
            ) from None
        if isinstance(exc, LocalEntryNotFoundError):  # the client's word for "unreachable"
            raise SourceNotFound(
                f"cannot reach the Hub at {endpoint} for {where} and {self.filename or 'it'} "
                "is not cached: check the network or pass a local directory"
            ) from None
        if isinstance(exc, EntryNotFoundError):
            raise SourceNotFound(f"{self.filename} not found in {where}") from None
        if isinstance(exc, OfflineModeIsEnabled):
            raise SourceNotFound(
                f"offline (HF_HUB_OFFLINE=1) and {where} is not in the local cache: "
                "unset HF_HUB_OFFLINE or pass a local directory"
            ) from None
        if isinstance(exc, HfHubHTTPError):
            raise MtpkitError(
                f"the Hub refused a request for {where}: {exc}".split("\n")[0]
            ) from None
        if isinstance(exc, (ConnectionError, OSError)) or "Connect" in type(exc).__name__:
            raise SourceNotFound(
                f"cannot reach the Hub at {endpoint} for {where} and it is not cached: "
                "check the network or pass a local directory"
            ) from None
        return False


def hub_timeouts() -> tuple[float, float]:
    """(a metadata request's, a download's) limits in seconds: huggingface_hub's own
    HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT (10 s each by default)."""
    from huggingface_hub import constants

    return float(constants.HF_HUB_ETAG_TIMEOUT), float(constants.HF_HUB_DOWNLOAD_TIMEOUT)


def _timed_out(exc: BaseException) -> bool:
    """A request that got no answer in time: the HTTP client's timeout classes (httpx's, or
    the fork huggingface_hub ships) or Python's own, raised directly or as the cause."""
    chain = [e for e in (exc, exc.__cause__, exc.__context__) if e is not None]
    return any("Timeout" in cls.__name__ for e in chain for cls in type(e).__mro__)


@contextmanager
def hub_progress(*, quiet: bool = False) -> Iterator[None]:
    """huggingface_hub's download and upload bars only on a terminal, and never `quiet`: a
    log or a pipe gets no `\\r` frames (HF_HUB_DISABLE_PROGRESS_BARS is honoured as before)."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    from mtpkit.core.console import is_terminal

    if are_progress_bars_disabled() or (is_terminal(sys.stderr) and not quiet):
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


# A repo's folder in the Hugging Face cache (`models--ORG--NAME`).
CACHE_REPO = re.compile(r"^models--(?P<org>[^-][^/]*?)--(?P<name>.+)$")


def source_repo(spec: str | None) -> str | None:
    """The Hub repo (`org/name`) a source spec names: the id itself (with or without
    `@REV`), or a Hugging Face cache folder of it; None for any other directory."""
    if not spec:
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        repo = spec.split("@", 1)[0]
        return repo if "/" in repo and REPO_ID.match(repo) else None
    for part in path.absolute().parts:
        match = CACHE_REPO.match(part)
        if match:
            return f"{match['org']}/{match['name']}"
    return None


def open_source(spec: str, *, revision: str | None = None) -> Source:
    """A local directory when `spec` names one, else a Hub repo id."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotACheckpoint(f"{spec} is a file; pass the checkpoint's directory")
        if revision is not None:
            raise MtpkitError(f"--revision applies to Hub repos, not to the directory {spec}")
        # Before listing the files: a directory such as /usr is not walked to say so.
        if not (path / "config.json").is_file():
            raise NotACheckpoint(
                f"{spec} has no config.json: not a model checkpoint "
                "(pass the folder that holds config.json and the safetensors files)"
            )
        return LocalSource(path)
    if spec.startswith((".", "/", "~")) or not REPO_ID.match(spec):
        raise SourceNotFound(
            f"no such directory {spec}, and it is not a Hub repo id (name or org/name)"
        )
    try:
        return HubSource(spec, revision)
    except SourceNotFound as e:
        offline = "offline" in str(e) or "cannot reach" in str(e)
        cached = _cached_snapshot(spec, revision) if offline else None
        if cached is None:
            if offline or str(e).startswith("no Hub repo"):
                raise SourceNotFound(
                    f"{spec} is neither a local directory nor reachable on the Hub: {e}"
                ) from None
            raise
        source = LocalSource(cached)
        source.spec, source.revision, source.commit = spec, revision, cached.name
        return source


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The snapshot folder already in the HF cache, for offline use."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        return None
