"""The write half of the loopback Hub stand-in (`tests/hub_server.py`): what `huggingface_hub`
2.4.0's `create_repo` and `create_commit` (hence `upload_folder` without hf_xet, and
`upload_file`) call, checked against its source (`hf_api.py`, `_commit_api.py`, `lfs.py`).

Endpoints (each needs `Authorization: Bearer ...`, as the Hub's write API does; 401 otherwise):

* ``POST /api/repos/create`` ``{name, organization, type?, visibility?}``: a new model repo whose
  first commit holds only ``.gitattributes`` (as the Hub's); an existing one answers 409, which
  ``create_repo(exist_ok=True)`` accepts. Answers ``{"url": ...}``.
* ``POST /api/validate-yaml`` ``{content, repoType}``: README front matter; a YAML error is a 400
  with ``errors``, as the Hub answers.
* ``POST /api/models/{repo}/preupload/{rev}`` ``{files: [{path, sample, size}]}``: each file's
  ``uploadMode`` (``lfs`` by the same rule `HubStandIn` serves files with) and the ``oid`` of the
  file already at that path in `rev` (the client skips unchanged files by it).
* ``POST /{repo}.git/info/lfs/objects/batch`` (git-lfs batch API, ``basic`` transfer): an
  ``upload`` action to ``PUT /__lfs__/{oid}`` and a ``verify`` action per object not stored yet.
* ``PUT /__lfs__/{oid}``: the object's bytes, checked against its sha256; ``POST /__lfs__/verify``.
* ``POST /api/models/{repo}/commit/{rev}`` (NDJSON: ``header``, ``file`` base64, ``lfsFile`` by
  oid, ``deletedFile``, ``deletedFolder``): one new commit with the branch moved to it, or
  nothing at all. An ``lfsFile`` whose object was never uploaded fails the whole commit (422).

* ``GET /api/whoami-v2``: the token's owner; a token holding ``read`` is a read-only token
  (``auth.accessToken.role == "read"``), any other ``hf_...`` token may write; anything else 401.
* ``DELETE /api/repos/delete`` ``{name, organization}``: removes a repo (404 if there is none).

Stalls a test injects (`HubStandIn.stall`, a set of `operation_of` names: ``create``,
``whoami``, ``info``, ``tree``, ``preupload``, ``lfs_batch``, ``lfs_put``, ``commit``,
``delete``): the
request is read, then never answered until `HubStandIn.release_stalls` is set (`stop` sets
it), when the connection is closed; `HubStandIn.stalled` lists the operations stalled so far.
`HubStandIn.silent_after` (an operation's name) applies that operation, drops its answer, and
from then on answers no request at all (a Hub that took a commit and went silent), or, with
`HubStandIn.stays_silent` False, answers the later ones (an answer lost on the way).

So an upload that fails half way (`HubStandIn.lfs_puts_before_failure`: later LFS PUTs answer
507, which the client does not retry; `HubStandIn.fail_commits`: the commit answers 500)
publishes nothing: uploaded objects are invisible until a commit names them, as on the Hub.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import TYPE_CHECKING, Any

from tests.hub_server import _File, _HttpError, _lfs_pointer, _Repo, git_blob_sha1

if TYPE_CHECKING:
    from tests.hub_server import HubStandIn, _Handler

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def operation_of(method: str, segments: list[str]) -> str | None:
    """The name a test stalls a request by (`HubStandIn.stall`), None for other requests."""
    if segments == ["api", "repos", "create"]:
        return "create"
    if segments == ["api", "repos", "delete"]:
        return "delete"
    if segments == ["api", "whoami-v2"]:
        return "whoami"
    if segments[:1] == ["__lfs__"]:
        return "lfs_put" if method == "PUT" else "lfs_verify"
    if segments[-4:] == ["info", "lfs", "objects", "batch"]:
        return "lfs_batch"
    if segments[:2] == ["api", "models"]:
        for name in ("tree", "preupload", "commit", "paths-info"):
            if name in segments[3:5]:
                return name
        return "info"  # model_info / repo_info, at a revision or not
    return None


def route(handler: _Handler, method: str, segments: list[str], query: dict, body: bytes) -> bool:
    """Answer a write request; False when `segments` is not a write endpoint."""
    hub = handler.server.hub
    if method == "GET" and segments == ["api", "whoami-v2"]:
        return _whoami(handler)
    if method == "DELETE" and segments == ["api", "repos", "delete"]:
        _authorized(handler)
        return _delete_repo(handler, hub, _json(body))
    if method == "POST" and segments == ["api", "repos", "create"]:
        _authorized(handler)
        return _create_repo(handler, hub, _json(body))
    if method == "POST" and segments == ["api", "validate-yaml"]:
        return _validate_yaml(handler, _json(body))
    if segments[:1] == ["__lfs__"] and len(segments) == 2:
        if method == "PUT":
            return _put_object(handler, hub, segments[1], body)
        if method == "POST" and segments[1] == "verify":
            return _verify_object(handler, hub, _json(body))
    if method == "POST" and segments[-4:] == ["info", "lfs", "objects", "batch"]:
        _authorized(handler)
        repo_id = "/".join(segments[:-4]).removesuffix(".git")
        _existing(handler, hub, repo_id)
        return _lfs_batch(handler, hub, _json(body))
    if method == "POST" and segments[:2] == ["api", "models"]:
        _, repo, rest = hub._find_repo(segments[2:])
        if rest[:1] in (["preupload"], ["commit"]) and len(rest) >= 2:
            _authorized(handler)
            if repo is None:
                raise handler._repo_not_found()
            revision = "/".join(rest[1:])
            if rest[0] == "preupload":
                return _preupload(handler, hub, repo, revision, _json(body))
            return _commit(handler, hub, repo, revision, body)
    return False


def _json(body: bytes) -> Any:
    try:
        return json.loads(body or b"{}")
    except ValueError as e:
        raise _HttpError(400, f"Invalid JSON body: {e}") from e


def _authorized(handler: _Handler) -> None:
    if not (handler.headers.get("Authorization") or "").startswith("Bearer "):
        raise _HttpError(401, "Invalid credentials in Authorization header", "Unauthorized")


def _existing(handler: _Handler, hub: HubStandIn, repo_id: str) -> _Repo:
    with hub._lock:
        repo = hub._repos.get(repo_id)
    if repo is None:
        raise handler._repo_not_found()
    return repo


def _whoami(handler: _Handler) -> bool:
    token = (handler.headers.get("Authorization") or "").removeprefix("Bearer ")
    if not token.startswith("hf_"):
        raise _HttpError(401, "Invalid credentials in Authorization header", "Unauthorized")
    role = "read" if "read" in token else "write"
    access = {"displayName": "stand-in", "role": role}
    handler._send_json({"type": "user", "name": "me", "auth": {"accessToken": access}})
    return True


def _delete_repo(handler: _Handler, hub: HubStandIn, payload: dict) -> bool:
    name, org = payload.get("name"), payload.get("organization")
    repo_id = f"{org}/{name}" if org else str(name)
    with hub._lock:
        if hub._repos.pop(repo_id, None) is None:
            raise handler._repo_not_found()
    handler._send_json({})
    return True


def _create_repo(handler: _Handler, hub: HubStandIn, payload: dict) -> bool:
    if payload.get("type") not in (None, "model"):
        raise _HttpError(400, "the stand-in serves model repos only")
    name, org = payload.get("name"), payload.get("organization")
    if not isinstance(name, str) or not name or "/" in name:
        raise _HttpError(400, f"Invalid repo name {name!r}")
    repo_id = f"{org}/{name}" if org else name
    assert hub.storage is not None
    with hub._lock:
        if repo_id in hub._repos:  # the Hub's 409 names the repo's url, which exist_ok returns
            message = "You already created this model repo"
            body = {"error": message, "url": f"{hub.url}/{repo_id}"}
            headers = {
                "Content-Type": "application/json; charset=utf-8",
                "X-Error-Message": message,
            }
            handler._send(409, headers, json.dumps(body).encode())
            return True
        disk = hub.storage / "blobs" / git_blob_sha1(GITATTRIBUTES)
        disk.parent.mkdir(parents=True, exist_ok=True)
        disk.write_bytes(GITATTRIBUTES)
        commit = hub._make_commit({".gitattributes": hub._file_entry(".gitattributes", disk)})
        repo = hub._repos[repo_id] = _Repo(repo_id)
        repo.commits[commit.sha] = commit
        repo.refs["main"] = commit.sha
    handler._send_json({"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
    return True


def _validate_yaml(handler: _Handler, payload: dict) -> bool:
    import yaml

    content = str(payload.get("content") or "")
    if content.startswith("---\n") and "\n---" in content[4:]:
        try:
            yaml.safe_load(content[4 : content.index("\n---", 4)])
        except yaml.YAMLError as e:
            errors = [{"message": f"Invalid YAML: {e}"}]
            handler._send(
                400,
                {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": "bad YAML"},
                json.dumps({"errors": errors, "warnings": []}).encode(),
            )
            return True
    handler._send_json({"errors": [], "warnings": []})
    return True


def _preupload(
    handler: _Handler, hub: HubStandIn, repo: _Repo, revision: str, payload: dict
) -> bool:
    commit = hub._commit(repo, revision)
    files = []
    for entry in payload.get("files", []):
        path, size = str(entry["path"]), int(entry["size"])
        lfs = hub.is_lfs(path, size) and size > 0
        current = commit.files.get(path)
        oid = None
        if current is not None:  # what the client compares with its own oid of the new file
            oid = current.sha256 if current.lfs else current.blob_oid
        files.append(
            {
                "path": path,
                "uploadMode": "lfs" if lfs else "regular",
                "shouldIgnore": False,
                "oid": oid,
            }
        )
    handler._send_json({"files": files, "commitOid": commit.sha})
    return True


def _lfs_batch(handler: _Handler, hub: HubStandIn, payload: dict) -> bool:
    if payload.get("operation") != "upload":
        raise _HttpError(400, "the stand-in takes LFS uploads only")
    objects = []
    for obj in payload.get("objects", []):
        oid, size = str(obj["oid"]), int(obj["size"])
        entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
        with hub._lock:
            stored = oid in hub.lfs_objects
        if not stored:
            entry["actions"] = {
                "upload": {"href": f"{hub.url}/__lfs__/{oid}", "header": {}},
                "verify": {"href": f"{hub.url}/__lfs__/verify", "header": {}},
            }
        objects.append(entry)
    body = json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode()
    handler._send(200, {"Content-Type": "application/vnd.git-lfs+json"}, body)
    return True


def _put_object(handler: _Handler, hub: HubStandIn, oid: str, body: bytes) -> bool:
    with hub._lock:
        if hub.lfs_puts_before_failure is not None:
            if hub.lfs_puts_before_failure <= 0:
                raise _HttpError(507, "Insufficient Storage (injected by the test)")
            hub.lfs_puts_before_failure -= 1
    if hashlib.sha256(body).hexdigest() != oid:
        raise _HttpError(400, f"object content does not match its oid {oid}")
    assert hub.storage is not None
    disk = hub.storage / "lfs" / oid
    disk.parent.mkdir(parents=True, exist_ok=True)
    disk.write_bytes(body)
    with hub._lock:
        hub.lfs_objects[oid] = disk
    handler._send(200, {"Content-Type": "text/plain"})
    return True


def _verify_object(handler: _Handler, hub: HubStandIn, payload: dict) -> bool:
    with hub._lock:
        disk = hub.lfs_objects.get(str(payload.get("oid")))
    if disk is None or disk.stat().st_size != int(payload.get("size", -1)):
        raise _HttpError(404, "object not found or of another size")
    handler._send_json({"success": True})
    return True


def _commit(handler: _Handler, hub: HubStandIn, repo: _Repo, revision: str, body: bytes) -> bool:
    if hub.fail_commits:
        raise _HttpError(500, "Internal Error (injected by the test)")
    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
    if not lines or lines[0].get("key") != "header":
        raise _HttpError(400, "a commit starts with its header")
    header = lines[0]["value"]
    parent = hub._commit(repo, revision)
    if header.get("parentCommit") and header["parentCommit"] != parent.sha:
        raise _HttpError(412, "A commit has happened since. Please refresh and try again.")
    files = dict(parent.files)
    for line in lines[1:]:
        key, value = line.get("key"), line.get("value") or {}
        path = str(value.get("path", "")).strip("/")
        if key == "file":
            files[path] = _regular_file(hub, path, base64.b64decode(value["content"]))
        elif key == "lfsFile":
            files[path] = _lfs_file(hub, path, str(value["oid"]), int(value["size"]))
        elif key == "deletedFile":
            if files.pop(path, None) is None:
                raise _HttpError(
                    404, f"A file with this name doesn't exist: {path}", "EntryNotFound"
                )
        elif key == "deletedFolder":
            for name in [n for n in files if n.startswith(path + "/")]:
                files.pop(name)
        else:
            raise _HttpError(400, f"unknown commit operation {key!r}")
    summary = str(header.get("summary", ""))
    commit = hub._make_commit(files, salt=f"{parent.sha}\0{summary}\0")
    branch = revision.removeprefix("refs/heads/")
    with hub._lock:
        repo.commits[commit.sha] = commit
        repo.refs[branch] = commit.sha
    handler._send_json(
        {
            "success": True,
            "commitOid": commit.sha,
            "commitUrl": f"{hub.url}/{repo.repo_id}/commit/{commit.sha}",
            "hookOutput": "",
        }
    )
    return True


def _regular_file(hub: HubStandIn, path: str, content: bytes) -> _File:
    assert hub.storage is not None
    disk = hub.storage / "blobs" / git_blob_sha1(content)
    disk.parent.mkdir(parents=True, exist_ok=True)
    disk.write_bytes(content)
    return hub._file_entry(path, disk)


def _lfs_file(hub: HubStandIn, path: str, oid: str, size: int) -> _File:
    with hub._lock:
        disk = hub.lfs_objects.get(oid)
    if disk is None or disk.stat().st_size != size:
        raise _HttpError(422, f"LFS object {oid} of {path} was never uploaded")
    pointer = _lfs_pointer(oid, size)
    return _File(path, disk, size, git_blob_sha1(pointer), oid, True, len(pointer))
