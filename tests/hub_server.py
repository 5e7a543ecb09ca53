"""A loopback stand-in for the Hugging Face Hub, for testing against the real ``huggingface_hub`` client.

``HubStandIn`` serves local folders as Hub *model* repos over plain HTTP on ``127.0.0.1`` (port chosen by
the OS) with the URL layout, headers and error codes that ``huggingface_hub`` 2.4.0 relies on. The
``hub`` pytest fixture starts one, points the client at it (``HF_ENDPOINT`` plus the module constants
that ``huggingface_hub`` computes at import time), gives it an empty temporary cache, and stops it
afterwards::

    from tests import hub_server
    from tests.hub_server import HubStandIn

    hub = hub_server.hub  # the fixture (``from tests.hub_server import hub`` also works, but
                          # ruff then flags every ``hub`` test argument as F811)

    def test_something(hub: HubStandIn, tmp_path):
        sha = hub.add_repo("org/tiny", tmp_path / "tiny")
        path = huggingface_hub.hf_hub_download("org/tiny", "config.json")
        assert hub.bytes_served["org/tiny/config.json"] == Path(path).stat().st_size

Endpoints served (what 2.4.0 really calls; checked against its source)
-----------------------------------------------------------------------
* ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}`` -- ``HfApi.model_info`` /
  ``repo_info`` (``?blobs=true`` adds ``siblings[].size``/``blobId``/``lfs``; ``?expand=...`` filters keys).
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=&cursor=`` -- ``list_repo_tree``,
  ``list_repo_files`` and ``snapshot_download``; paginated with a GitHub-style ``Link: rel="next"``
  header every ``tree_page_size`` entries, like the Hub.
* ``POST /api/models/{repo}/paths-info/{rev}`` -- ``get_paths_info`` (and ``HfFileSystem``).
* ``GET /api/models/{repo}/refs`` -- ``list_repo_refs``.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` -- ``hf_hub_download``, ``get_hf_file_metadata``,
  ``file_exists``, ranged reads. Headers: ``ETag`` (quoted; the file's sha256 for LFS files, else its git
  blob sha1), ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges: bytes``, and for LFS files
  ``X-Linked-Etag``/``X-Linked-Size`` too. ``Range`` (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) answers
  206 with ``Content-Range``; a start past the end answers 416 (``Content-Range: bytes */size``); a
  multi-range or malformed ``Range`` is ignored and the whole file is sent (200), as S3/CloudFront do.
  The real Hub answers LFS files with a 302 to a CDN; this server answers 200 directly.

A file counts as LFS (``lfs`` info in listings, sha256 ETag) when its suffix is in ``LFS_SUFFIXES``
(``.safetensors``, ``.bin``, ``.gguf``, ... as in the Hub's default ``.gitattributes``) or it is at least
``LFS_MIN_SIZE`` bytes. Both are instance attributes you may change before ``add_repo``.

Errors, as the Hub sends them (``X-Error-Code`` + ``X-Error-Message`` headers, JSON ``{"error": ...}``):

==========================  ============================================  ====================================
case                        status / ``X-Error-Code``                     raised by ``hf_raise_for_status``
==========================  ============================================  ====================================
unknown repo                401 anonymous, 404 with a token / RepoNotFound ``RepositoryNotFoundError``
unknown revision            404 / RevisionNotFound                         ``RevisionNotFoundError``
unknown file or tree path   404 / EntryNotFound (+ ``X-Repo-Commit``)      ``RemoteEntryNotFoundError``
``..``, ``.``, empty, ``\\``  400 (no code)                                  ``BadRequestError``
range past the end          416                                            ``HfHubHTTPError``
==========================  ============================================  ====================================

``RemoteEntryNotFoundError`` subclasses both ``HfHubHTTPError`` and ``EntryNotFoundError``; all of these
live in ``huggingface_hub.errors`` (also re-exported from ``huggingface_hub.utils``). ``hf_hub_download``
turns a connection failure or a 5xx into ``LocalEntryNotFoundError`` when nothing is cached.

Counters: ``bytes_served["repo_id/path"]`` adds up the file-body bytes handed to the socket by ``GET
/resolve`` (HEAD answers, API JSON and error bodies are not counted; a client that hangs up early may
have received less than was written). ``requests`` logs ``(method, raw path with query, {header: value})``
for the headers in ``_LOGGED_HEADERS`` (lower-cased). ``reset_counters()`` clears both. Internal
errors of the stand-in answer 500 and are kept in ``errors``; the fixture fails the test if any occurred.

Path safety: only files found under the folder at ``add_repo`` time are indexed (symlinks whose target
lies outside the folder, ``.git/`` and ``.cache/huggingface/`` are skipped) and a request is answered by
looking up its path in that index, so no request path can reach anything else; ``.``/``..``/empty
segments, backslashes and NUL bytes (raw or percent-encoded) are refused with 400 before any lookup.
Files are hashed at ``add_repo`` time and streamed from disk on request: do not change a folder after
adding it (call ``add_repo`` again to publish a new commit instead).

Ranged reads with the real client (what mtpkit should call)
-----------------------------------------------------------
``huggingface_hub`` 2.4.0 (which is built on ``httpx2``, not ``requests``) has no dedicated "read bytes
a..b of a remote file" function. Its own safetensors-header reader (``HfApi.parse_safetensors_file_metadata``)
and ``HfFileSystemFile._fetch_range`` both do exactly this, and it is the recommended pattern::

    from huggingface_hub import constants, get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = hf_hub_url(repo_id, filename, revision=commit_sha_or_branch)  # uses HF_ENDPOINT at call time
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{start + length - 1}"}  # inclusive end
    r = get_session().get(url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
    hf_raise_for_status(r)      # maps X-Error-Code to RepositoryNotFoundError & co.
    data = r.content if r.status_code == 206 else r.content[start:start + length]

* ``get_session()`` is the shared ``httpx2.Client`` (``follow_redirects=True``, offline-mode hook); it has
  *no* default timeout, so pass one. ``build_hf_headers()`` adds the token and user agent (the session does
  not); httpx drops ``Authorization`` on the cross-host redirect to the CDN by itself.
* ``huggingface_hub.utils.http_backoff("GET", url, headers=..., timeout=...)`` is the same call with
  retries on 408/429/5xx and network errors (it sleeps 1, 2, 4, 8, 8 s between tries).
* To read a whole safetensors header, ``HfApi().parse_safetensors_file_metadata(repo_id, filename,
  revision=...)`` does it in one GET of ``bytes=0-100000`` (a second one if the header is bigger) and
  returns ``SafetensorsFileMetadata`` (``.metadata``, ``.tensors[name].dtype/.shape/.data_offsets``).
* ``HfFileSystem(skip_instance_cache=True).open(f"{repo_id}/{path}", "rb", revision=...)`` works
  against this server too, but is not for byte-exact reads: ``f.read(8)`` on a 3 MB file fetched all
  3 MB (5 MB fsspec read-ahead block), and ``block_size=0`` streams from byte 0 with no ``Range``.

``read_range`` below wraps the first pattern for tests.

What the client reads at import time (so the fixture patches it as well as the environment)
------------------------------------------------------------------------------------------
``huggingface_hub.constants`` computes ``ENDPOINT``, ``HUGGINGFACE_CO_URL_TEMPLATE``, ``HF_URL_HOSTS``,
``HF_HOME``, ``HF_HUB_CACHE``/``HUGGINGFACE_HUB_CACHE``, ``HF_ASSETS_CACHE``, ``HF_XET_CACHE``,
``HF_TOKEN_PATH``, ``HF_STORED_TOKENS_PATH``, ``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_TELEMETRY`` and
``HF_HUB_DISABLE_XET`` once, at import. Also fixed at import: the module-level ``HfApi`` behind
``huggingface_hub.model_info``/``list_repo_files``/... (``huggingface_hub.hf_api.api.endpoint``), the
set of trusted redirect origins (``huggingface_hub.utils._http._HUB_ORIGINS``), and
``utils._cache_manager.HF_HUB_CACHE`` / ``utils._cache_assets.HF_ASSETS_CACHE``. A fresh ``HfApi()``,
``hf_hub_url``, ``hf_hub_download`` and ``snapshot_download`` read ``constants`` at call time. The shared
``httpx2.Client`` reads proxy variables when created, so the fixture adds ``127.0.0.1`` to ``NO_PROXY``
and calls ``close_session()`` before and after each test.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

import pytest

__all__ = ["HubStandIn", "hub", "point_client_at", "read_range", "git_blob_sha1"]

_FIXED_DATE = "2024-01-01T00:00:00.000Z"
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$", re.IGNORECASE)
_CHUNK = 64 * 1024
# Request headers kept in `HubStandIn.requests` (lower-cased names).
_LOGGED_HEADERS = (
    "range",
    "authorization",
    "user-agent",
    "accept-encoding",
    "x-hf-download-counter",
    "if-none-match",
    "content-type",
)
_REPO_OPS = {"revision", "tree", "paths-info", "refs", "resolve", "preupload", "commit"}


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with these contents (what the Hub uses as a non-LFS file's ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return (
        f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    )


@dataclass(frozen=True)
class _File:
    path: str  # posix path inside the repo
    disk: Path
    size: int
    blob_oid: str  # git blob sha1 (of the LFS pointer for LFS files, as in git)
    sha256: str
    lfs: bool
    pointer_size: int

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_oid


@dataclass
class _Commit:
    sha: str
    files: dict[str, _File]
    dirs: dict[str, str]  # folder path -> tree oid
    config: dict | None = None
    safetensors: dict | None = None
    card: dict | None = None  # README.md's YAML front matter, as the Hub parses it


@dataclass
class _Repo:
    repo_id: str
    refs: dict[str, str] = field(default_factory=dict)  # branch name -> commit sha
    commits: dict[str, _Commit] = field(default_factory=dict)
    default_branch: str = "main"


class _HttpError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = headers or {}


class _Unsatisfiable(Exception):
    pass


def _hash_file(path: Path) -> tuple[int, str, str]:
    """(size, git blob sha1, sha256) of a file, read in chunks."""
    size = path.stat().st_size
    sha1 = hashlib.sha1(b"blob %d\0" % size)
    sha256 = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha1.update(chunk)
            sha256.update(chunk)
    return size, sha1.hexdigest(), sha256.hexdigest()


def _safetensors_params(path: Path) -> dict[str, int]:
    """Parameter count per dtype from a safetensors header ({} if it is not one)."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return {}
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return {}
    counts: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        count = 1
        for dim in info.get("shape", []):
            count *= int(dim)
        counts[info.get("dtype", "?")] = counts.get(info.get("dtype", "?"), 0) + count
    return counts


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """Inclusive (start, end) for a single `bytes=` range, None to send the whole file.

    Raises `_Unsatisfiable` when the range cannot be served (-> 416).
    """
    if header is None or "," in header:
        return None
    match = _RANGE_RE.match(header)
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # suffix: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - n), size - 1
    start = int(first)
    if start >= size:
        raise _Unsatisfiable
    end = int(last) if last else size - 1
    if end < start:  # syntactically invalid: ignored, as RFC 9110 says
        return None
    return start, min(end, size - 1)


def _check_path(path: str, what: str) -> str:
    """Refuse anything that is not a plain relative posix path."""
    parts = path.split("/")
    if not path or "\\" in path or "\0" in path or any(part in ("", ".", "..") for part in parts):
        raise _HttpError(400, f"Invalid {what}: {path!r}")
    return path


class HubStandIn:
    """Serves local folders as Hub model repos to the real ``huggingface_hub`` client."""

    # Suffixes the Hub's default .gitattributes stores with git-lfs.
    LFS_SUFFIXES = frozenset(
        ".safetensors .bin .gguf .pt .pth .ckpt .h5 .msgpack .onnx .npz .npy .pkl .pickle .model"
        " .tflite .ot .zip .tar .gz .7z .arrow .parquet .joblib .mlmodel .pb .wasm .zst .xz".split()
    )
    LFS_MIN_SIZE = 10 * 1024 * 1024

    def __init__(self) -> None:
        self.lfs_suffixes: frozenset[str] = self.LFS_SUFFIXES
        self.lfs_min_size: int = self.LFS_MIN_SIZE
        self.tree_page_size: int = 1000  # entries per /tree page before a Link: rel="next"
        self.bytes_served: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.errors: list[str] = []  # internal server errors (tracebacks), should stay empty
        self._repos: dict[str, _Repo] = {}
        # The write side (`tests/hub_upload.py`): LFS objects by sha256, kept on disk under
        # `storage` while the server runs; failures a test injects.
        self.storage: Path | None = None
        self.lfs_objects: dict[str, Path] = {}
        self.lfs_puts_before_failure: int | None = None  # then every LFS PUT answers 507
        self.fail_commits = False  # every commit answers 500 (nothing is committed)
        # Operations never answered (`hub_upload.operation_of` names), until released.
        self.stall: set[str] = set()
        self.stalled: list[str] = []
        # An operation applied but never answered, after which no request is answered (a Hub
        # that took a commit and went silent); `stalled` then lists the silenced requests.
        self.silent_after: str | None = None
        self.stays_silent = True  # False: only that operation's answer is lost
        self.silent = False
        self.release_stalls = threading.Event()
        self._lock = threading.RLock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- repos
    def add_repo(
        self,
        repo_id: str,
        folder: Path,
        *,
        revision: str = "main",
        commit_sha: str | None = None,
    ) -> str:
        """Publish `folder` as commit `commit_sha` of `repo_id` and point branch `revision` at it.

        Returns the 40-hex commit sha (derived from the file paths and contents when not given).
        Adding the same `revision` again moves the branch; older commits stay reachable by sha.
        """
        if (
            not repo_id
            or repo_id.count("/") > 1
            or any(p in ("", ".", "..") for p in repo_id.split("/"))
        ):
            raise ValueError(f"bad repo_id {repo_id!r}")
        if not revision or _SHA_RE.match(revision):
            raise ValueError(f"revision must be a branch name, not {revision!r}")
        folder = Path(folder)
        root = folder.resolve()
        if not root.is_dir():
            raise NotADirectoryError(folder)
        files: dict[str, _File] = {}
        for disk in sorted(folder.rglob("*")):
            rel = disk.relative_to(folder).as_posix()
            if rel.split("/")[0] == ".git" or rel.startswith(".cache/huggingface"):
                continue
            real = disk.resolve()
            if not real.is_file() or not real.is_relative_to(root):
                continue  # folders, and links that lead outside the repo folder
            files[rel] = self._file_entry(rel, real)
        commit = self._make_commit(files, commit_sha)
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                repo = self._repos[repo_id] = _Repo(repo_id, default_branch=revision)
            repo.commits[commit.sha] = commit
            repo.refs[revision] = commit.sha
        return commit.sha

    def is_lfs(self, path: str, size: int) -> bool:
        """Whether the Hub stores a file of this name and size with git-lfs."""
        return Path(path).suffix.lower() in self.lfs_suffixes or size >= self.lfs_min_size

    def _file_entry(self, rel: str, real: Path) -> _File:
        size, git_sha, sha256 = _hash_file(real)
        lfs = self.is_lfs(rel, size)
        pointer = _lfs_pointer(sha256, size)
        return _File(
            path=rel,
            disk=real,
            size=size,
            blob_oid=git_blob_sha1(pointer) if lfs else git_sha,
            sha256=sha256,
            lfs=lfs,
            pointer_size=len(pointer),
        )

    def _make_commit(
        self, files: dict[str, _File], commit_sha: str | None = None, salt: str = ""
    ) -> _Commit:
        """A commit of exactly `files` (its sha derived from them and `salt` when not given)."""
        dirs: dict[str, str] = {}
        for rel in files:
            parts = rel.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.setdefault("/".join(parts[:i]), "")
        for d in dirs:
            listing = "".join(
                f"{p}\0{f.blob_oid}\n" for p, f in sorted(files.items()) if p.startswith(d + "/")
            )
            dirs[d] = hashlib.sha1(f"tree\0{d}\0{listing}".encode()).hexdigest()
        if commit_sha is None:
            listing = "".join(f"{p}\0{f.blob_oid}\n" for p, f in sorted(files.items()))
            commit_sha = hashlib.sha1(f"commit\0{salt}{listing}".encode()).hexdigest()
        commit_sha = commit_sha.lower()
        if not _SHA_RE.match(commit_sha):
            raise ValueError(f"commit_sha must be 40 hex digits, got {commit_sha!r}")
        config = None
        if "config.json" in files:
            try:
                raw = json.loads(files["config.json"].disk.read_text())
                config = {k: raw[k] for k in ("architectures", "model_type") if k in raw}
            except (OSError, ValueError):
                config = None
        params: dict[str, int] = {}
        for rel, f in files.items():
            if rel.endswith(".safetensors"):
                for dtype, n in _safetensors_params(f.disk).items():
                    params[dtype] = params.get(dtype, 0) + n
        safetensors = {"parameters": params, "total": sum(params.values())} if params else None
        return _Commit(commit_sha, files, dirs, config, safetensors, _card_data(files))

    # ------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("HubStandIn is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        if self._server is not None:
            return
        server = _Server(("127.0.0.1", 0), _Handler)
        server.hub = self
        self.storage = Path(tempfile.mkdtemp(prefix="hub-stand-in-"))
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="hub-stand-in",
            daemon=True,
        )
        self._server, self._thread = server, thread
        thread.start()

    def stop(self) -> None:
        self.release_stalls.set()
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.close_connections()
        if thread is not None:
            thread.join(timeout=5)
        if self.storage is not None:
            shutil.rmtree(self.storage, ignore_errors=True)
            self.storage = None

    def __enter__(self) -> HubStandIn:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------- counters
    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_served.clear()
            self.requests.clear()

    def total_bytes(self, repo_id: str | None = None) -> int:
        with self._lock:
            if repo_id is None:
                return sum(self.bytes_served.values())
            prefix = repo_id + "/"
            return sum(n for key, n in self.bytes_served.items() if key.startswith(prefix))

    def _count(self, key: str, n: int) -> None:
        with self._lock:
            self.bytes_served[key] = self.bytes_served.get(key, 0) + n

    # ---------------------------------------------------------------- lookup
    def _find_repo(self, segments: list[str]) -> tuple[str, _Repo | None, list[str]]:
        """Split ``[ns, name, *rest]`` / ``[name, *rest]`` into a repo id and the rest."""
        with self._lock:
            if len(segments) >= 2 and f"{segments[0]}/{segments[1]}" in self._repos:
                repo_id = f"{segments[0]}/{segments[1]}"
                return repo_id, self._repos[repo_id], segments[2:]
            if segments and segments[0] in self._repos:
                return segments[0], self._repos[segments[0]], segments[1:]
        if len(segments) >= 2 and segments[1] not in _REPO_OPS:
            return f"{segments[0]}/{segments[1]}", None, segments[2:]
        return (segments[0] if segments else ""), None, segments[1:]

    def _commit(self, repo: _Repo, revision: str | None) -> _Commit:
        rev = repo.default_branch if revision is None else revision
        _check_path(rev, "revision")
        with self._lock:
            name = rev.removeprefix("refs/heads/")
            if name in repo.refs:
                return repo.commits[repo.refs[name]]
            if rev.lower() in repo.commits:
                return repo.commits[rev.lower()]
        raise _HttpError(404, f"Invalid rev id: {rev}", "RevisionNotFound")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # never wait on handler threads; stop() closes their sockets instead
    hub: HubStandIn

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub; every answer has a Content-Length
    server_version = "HubStandIn/1.0"
    timeout = 30  # idle keep-alive connections give up after this
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr logging
        pass

    def do_GET(self) -> None:  # noqa: N802
        self._handle("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    # ---------------------------------------------------------------- plumbing
    def _handle(self, method: str) -> None:
        hub = self.server.hub
        selected = {k: v for k in _LOGGED_HEADERS if (v := self.headers.get(k)) is not None}
        with hub._lock:
            hub.requests.append((method, self.path, selected))
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length > 0 else b""
            if self._stalled(method):
                return
            if self._silenced(method, body):
                return
            self._route(method, body)
        except _HttpError as e:
            self._send_error(e)
        except (ConnectionError, TimeoutError):  # the client hung up (e.g. after a partial read)
            self.close_connection = True
        except Exception as e:  # a bug in the stand-in: report it loudly, never hang the client
            import traceback

            with hub._lock:
                hub.errors.append(traceback.format_exc())
            self._send_error(_HttpError(500, f"stand-in crashed: {e!r}"))

    def _operation(self, method: str) -> str | None:
        from tests.hub_upload import operation_of

        return operation_of(method, [unquote(s) for s in urlsplit(self.path).path.split("/")[1:]])

    def _silenced(self, method: str, body: bytes) -> bool:
        """Apply the `HubStandIn.silent_after` operation with its answer dropped, then hold
        it and every later request unanswered until released."""
        hub = self.server.hub
        operation = self._operation(method)
        if operation is None or operation != hub.silent_after or operation in hub.stalled:
            return False
        answer, self.wfile = self.wfile, io.BytesIO()
        try:
            self._route(method, body)
        finally:
            self.wfile = answer
        with hub._lock:
            hub.silent = hub.stays_silent
            hub.stalled.append(operation)
        hub.release_stalls.wait()
        self.close_connection = True
        return True

    def _stalled(self, method: str) -> bool:
        """Hold a request a test stalls (`HubStandIn.stall`, or any once `silent`)
        unanswered until released."""
        hub = self.server.hub
        operation = self._operation(method)
        if not hub.silent and (operation is None or operation not in hub.stall):
            return False
        with hub._lock:
            hub.stalled.append(operation)
        hub.release_stalls.wait()
        self.close_connection = True
        return True

    def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _send_json(self, data: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(data).encode()
        self._send(
            200, {"Content-Type": "application/json; charset=utf-8", **(headers or {})}, body
        )

    def _send_error(self, e: _HttpError) -> None:
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": e.message}
        if e.code:
            headers["X-Error-Code"] = e.code
        headers.update(e.headers)
        try:
            self._send(e.status, headers, json.dumps({"error": e.message}).encode())
        except (ConnectionError, TimeoutError):
            self.close_connection = True

    def _repo_not_found(self) -> _HttpError:
        # The Hub answers 401 to anonymous requests for a repo it will not show, 404 with a token.
        status = 404 if self.headers.get("Authorization") else 401
        return _HttpError(status, "Repository not found", "RepoNotFound")

    # ------------------------------------------------------------------ routes
    def _route(self, method: str, body: bytes) -> None:
        split = urlsplit(self.path)
        segments = [unquote(s) for s in split.path.split("/")[1:]]
        query = parse_qs(split.query, keep_blank_values=True)
        for seg in segments:  # `..` & co anywhere in the path, raw or percent-encoded
            if seg in (".", "..") or "\0" in seg or "\\" in seg or ".." in seg.split("/"):
                raise _HttpError(400, f"Invalid path: {split.path!r}")
        hub = self.server.hub
        from tests import hub_upload  # the write endpoints (create_repo, commits, LFS)

        if hub_upload.route(self, method, segments, query, body):
            return
        if segments[:1] == ["api"]:
            if len(segments) >= 3 and segments[1] in ("datasets", "spaces", "kernels"):
                raise self._repo_not_found()
            if len(segments) >= 3 and segments[1] == "models":
                _, repo, rest = hub._find_repo(segments[2:])
                if repo is None:
                    raise self._repo_not_found()
                return self._api(method, repo, rest, query, body)
            raise _HttpError(404, "Not Found")
        if segments[:1] in (["datasets"], ["spaces"], ["kernels"]):
            raise self._repo_not_found()
        if "resolve" in segments[1:3]:
            _, repo, rest = hub._find_repo(segments)
            if repo is None:
                raise self._repo_not_found()
            if rest[:1] == ["resolve"] and len(rest) >= 3 and method in ("GET", "HEAD"):
                return self._resolve(method, repo, rest[1], "/".join(rest[2:]))
        raise _HttpError(404, "Not Found")

    def _api(self, method: str, repo: _Repo, rest: list[str], query: dict, body: bytes) -> None:
        hub = self.server.hub
        op = rest[0] if rest else None
        if method == "GET" and op is None:
            return self._model_info(repo, hub._commit(repo, None), query)
        if method == "GET" and op == "revision" and len(rest) >= 2:
            return self._model_info(repo, hub._commit(repo, "/".join(rest[1:])), query)
        if method == "GET" and op == "tree" and len(rest) >= 2:
            commit = hub._commit(repo, rest[1])
            return self._tree(repo, commit, "/".join(rest[2:]), query)
        if method == "POST" and op == "paths-info" and len(rest) >= 2:
            commit = hub._commit(repo, "/".join(rest[1:]))
            return self._paths_info(commit, body)
        if method == "GET" and op == "refs" and len(rest) == 1:
            with hub._lock:
                branches = [
                    {"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha}
                    for name, sha in repo.refs.items()
                ]
            data: dict[str, Any] = {"branches": branches, "converts": [], "tags": []}
            if query.get("include_prs"):
                data["pullRequests"] = []
            return self._send_json(data)
        if method in ("GET", "HEAD", "POST"):
            raise _HttpError(404, "Not Found")
        raise _HttpError(405, f"{method} is not supported by the stand-in")

    def _model_info(self, repo: _Repo, commit: _Commit, query: dict) -> None:
        blobs = _truthy(query.get("blobs"))
        siblings = []
        for f in sorted(commit.files.values(), key=lambda f: f.path):
            sibling: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sibling.update(size=f.size, blobId=f.blob_oid)
                if f.lfs:
                    sibling["lfs"] = {
                        "size": f.size,
                        "sha256": f.sha256,
                        "pointerSize": f.pointer_size,
                    }
            siblings.append(sibling)
        author = repo.repo_id.split("/")[0] if "/" in repo.repo_id else None
        data: dict[str, Any] = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": author,
            "sha": commit.sha,
            "lastModified": _FIXED_DATE,
            "createdAt": _FIXED_DATE,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": _card_tags(commit.card),
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(f.size for f in commit.files.values()),
        }
        if commit.config is not None:
            data["config"] = commit.config
        if commit.card is not None:
            data["cardData"] = commit.card
        if commit.safetensors is not None:
            data["safetensors"] = commit.safetensors
        expand = query.get("expand", []) + query.get("expand[]", [])
        if expand:
            data = {k: v for k, v in data.items() if k in ("_id", "id") or k in expand}
        self._send_json(data)

    def _entry(self, commit: _Commit, path: str, expand: bool) -> dict[str, Any]:
        if path in commit.files:
            f = commit.files[path]
            entry: dict[str, Any] = {
                "type": "file",
                "oid": f.blob_oid,
                "size": f.size,
                "path": path,
            }
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
        else:
            entry = {"type": "directory", "oid": commit.dirs[path], "size": 0, "path": path}
        if expand:
            entry["lastCommit"] = {
                "id": commit.sha,
                "title": "Stand-in commit",
                "date": _FIXED_DATE,
            }
        return entry

    def _tree(self, repo: _Repo, commit: _Commit, path: str, query: dict) -> None:
        hub = self.server.hub
        path = path.strip("/")
        if path:
            _check_path(path, "path")
            if path not in commit.dirs:
                raise _HttpError(
                    404,
                    f"Entry not found: {path}",
                    "EntryNotFound",
                    {"X-Repo-Commit": commit.sha},
                )
        recursive = _truthy(query.get("recursive"))
        expand = _truthy(query.get("expand"))
        prefix = path + "/" if path else ""
        paths = [p for p in [*commit.dirs, *commit.files] if p.startswith(prefix)]
        if not recursive:
            paths = [p for p in paths if "/" not in p[len(prefix) :]]
        paths.sort(key=lambda p: (p not in commit.dirs, p))  # folders first, like the Hub
        try:
            cursor = max(0, int((query.get("cursor") or ["0"])[0]))
        except ValueError as e:
            raise _HttpError(400, "Invalid cursor") from e
        size = max(1, hub.tree_page_size)
        page = paths[cursor : cursor + size]
        headers = {}
        if cursor + size < len(paths):
            next_query = {k: v for k, v in query.items() if k != "cursor"}
            next_query["cursor"] = [str(cursor + size)]
            next_url = f"{hub.url}{urlsplit(self.path).path}?{urlencode(next_query, doseq=True)}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._send_json([self._entry(commit, p, expand) for p in page], headers)

    def _paths_info(self, commit: _Commit, body: bytes) -> None:
        content_type = self.headers.get("Content-Type", "")
        if "json" in content_type:
            payload = json.loads(body or b"{}")
            paths = payload.get("paths", [])
            expand = bool(payload.get("expand", False))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = _truthy(form.get("expand"))
        entries = []
        for path in paths:
            path = path.strip("/")
            if path in commit.files or path in commit.dirs:
                entries.append(self._entry(commit, path, expand))
        self._send_json(entries)

    def _resolve(self, method: str, repo: _Repo, revision: str, filename: str) -> None:
        hub = self.server.hub
        commit = hub._commit(repo, revision)
        _check_path(filename, "path")
        f = commit.files.get(filename)
        if f is None:
            raise _HttpError(
                404,
                "Entry not found",
                "EntryNotFound",
                {"X-Repo-Commit": commit.sha},
            )
        name = quote(filename.rsplit("/", 1)[-1])
        headers = {
            "Content-Type": "application/octet-stream" if f.lfs else "text/plain; charset=utf-8",
            "Content-Disposition": f"inline; filename*=UTF-8''{name}; filename=\"{name}\";",
            "ETag": f'"{f.etag}"',
            "X-Repo-Commit": commit.sha,
            "Accept-Ranges": "bytes",
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(f.size)
        try:
            byte_range = _parse_range(self.headers.get("Range"), f.size)
        except _Unsatisfiable:
            raise _HttpError(
                416,
                "Requested Range Not Satisfiable",
                headers={"Content-Range": f"bytes */{f.size}", "X-Repo-Commit": commit.sha},
            ) from None
        if byte_range is None:
            status, start, length = 200, 0, f.size
        else:
            start, end = byte_range
            status, length = 206, end - start + 1
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        headers["Content-Length"] = str(length)
        self._send(status, headers)
        if method == "HEAD" or length == 0:
            return
        key = f"{repo.repo_id}/{f.path}"
        with f.disk.open("rb") as fh:
            fh.seek(start)
            remaining = length
            while remaining:
                chunk = fh.read(min(_CHUNK, remaining))
                if not chunk:  # file shrank on disk: end the connection, the client will notice
                    self.close_connection = True
                    return
                # Counted before the write: the client may finish reading (and the test look at
                # the counter) before this thread runs again after the last write.
                hub._count(key, len(chunk))
                self.wfile.write(chunk)
                remaining -= len(chunk)


def _card_data(files: dict[str, _File]) -> dict | None:
    """README.md's YAML front matter (the Hub's `cardData`), None without one."""
    readme = files.get("README.md")
    if readme is None:
        return None
    text = readme.disk.read_text(errors="replace")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return None
    import yaml

    try:
        data = yaml.safe_load(text[4 : text.index("\n---", 4)])
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def _card_tags(card: dict | None) -> list[str]:
    """The tags the Hub shows for a card: its `tags`, its library and `base_model:` ones."""
    if not card:
        return []
    tags = [str(t) for t in card.get("tags") or []]
    if card.get("library_name"):
        tags.append(str(card["library_name"]))
    bases = card.get("base_model") or []
    for base in [bases] if isinstance(bases, str) else bases:
        tags.append(f"base_model:{base}")
    return list(dict.fromkeys(tags))


def _truthy(values: list[str] | None) -> bool:
    return bool(values) and values[-1].lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------- client side
def read_range(
    repo_id: str,
    filename: str,
    start: int,
    end: int | None = None,
    *,
    revision: str | None = None,
) -> bytes:
    """Bytes ``[start, end)`` of a remote file (to the end if `end` is None), via the real client.

    The exact pattern mtpkit should use (see the module docstring): ``hf_hub_url`` + ``get_session().get``
    with a ``Range`` header + ``hf_raise_for_status``.
    """
    from huggingface_hub import constants, get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    if start < 0 or (end is not None and end <= start):
        raise ValueError(f"bad range [{start}, {end})")
    url = hf_hub_url(repo_id, filename, revision=revision)
    span = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
    headers = {**build_hf_headers(), "Range": span}
    response = get_session().get(url, headers=headers, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
    hf_raise_for_status(response)
    if response.status_code == 200:  # Range ignored by the server: keep only what was asked
        return response.content[start:end]
    return response.content


def point_client_at(endpoint: str, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the (already imported) ``huggingface_hub`` at `endpoint`, with an empty cache in `home`.

    Sets the environment for anything imported later and patches what was computed at import time.
    """
    import huggingface_hub
    import huggingface_hub.hf_api  # noqa: F401 - lazily imported by the package; patched below
    from huggingface_hub import constants
    from huggingface_hub.utils import _cache_assets, _cache_manager, _http

    home = Path(home)
    hub_cache, assets, xet = str(home / "hub"), str(home / "assets"), str(home / "xet")
    token_path = str(home / "token")
    env = {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": hub_cache,
        "HF_ASSETS_CACHE": assets,
        "HF_XET_CACHE": xet,
        "HF_TOKEN_PATH": token_path,
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_OIDC_RESOURCE",
        "HF_OIDC_ID_TOKEN",
        "HUGGINGFACE_CO_STAGING",
        "HUGGINGFACE_HUB_CACHE",
        "HUGGINGFACE_ASSETS_CACHE",
    ):
        monkeypatch.delenv(key, raising=False)
    for key in ("NO_PROXY", "no_proxy"):  # never send loopback traffic through a proxy
        current = os.environ.get(key)
        monkeypatch.setenv(
            key, f"{current},127.0.0.1,localhost" if current else "127.0.0.1,localhost"
        )

    patches: dict[str, Any] = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_URL_HOSTS": frozenset(constants.HF_URL_HOSTS | {"127.0.0.1"}),
        "HF_HOME": str(home),
        "default_cache_path": hub_cache,
        "default_assets_cache_path": assets,
        "HUGGINGFACE_HUB_CACHE": hub_cache,
        "HF_HUB_CACHE": hub_cache,
        "HUGGINGFACE_ASSETS_CACHE": assets,
        "HF_ASSETS_CACHE": assets,
        "default_xet_cache_path": xet,
        "HF_XET_CACHE": xet,
        "HF_TOKEN_PATH": token_path,
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_UPDATE_CHECK": True,
    }
    for name, value in patches.items():
        monkeypatch.setattr(constants, name, value, raising=False)
    # Bound at import time elsewhere:
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", endpoint)
    monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", hub_cache, raising=False)
    monkeypatch.setattr(_cache_assets, "HF_ASSETS_CACHE", assets, raising=False)
    origins = getattr(_http, "_HUB_ORIGINS", None)
    if origins is not None:
        monkeypatch.setattr(
            _http, "_HUB_ORIGINS", frozenset(origins | {_http._url_origin(endpoint)})
        )


@pytest.fixture
def hub(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubStandIn]:
    """A started `HubStandIn` with the real client pointed at it and an empty HF cache."""
    from huggingface_hub import close_session

    server = HubStandIn()
    server.start()
    try:
        point_client_at(server.url, tmp_path_factory.mktemp("hf_home"), monkeypatch)
        close_session()  # a fresh httpx2.Client, created under the patched environment
        yield server
    finally:
        close_session()  # drop keep-alive connections to this server
        server.stop()
    assert not server.errors, "hub stand-in crashed:\n" + "\n".join(server.errors)
