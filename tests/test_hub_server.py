"""The Hub stand-in, exercised through the real ``huggingface_hub`` client."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import struct
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import (
    HfApi,
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    BadRequestError,
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

from tests import hub_server
from tests.hub_server import HubStandIn, git_blob_sha1, read_range

hub = hub_server.hub  # the fixture; bound by assignment so ruff sees no shadowed import (F811)

REPO = "acme/tiny-mtp"
SECRET = b"top secret, outside the repo\n"


def _safetensors(
    tensors: dict[str, tuple[str, list[int], bytes]], meta: dict | None = None
) -> bytes:
    header: dict = {"__metadata__": meta or {"format": "pt"}}
    offset, blobs = 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def _make_repo(root: Path, hidden: int = 4) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(
        json.dumps({"model_type": "tiny", "architectures": ["TinyForCausalLM"], "hidden": hidden})
    )
    (root / "model.safetensors").write_bytes(
        _safetensors(
            {"w": ("F32", [2, hidden], struct.pack(f"<{2 * hidden}f", *range(2 * hidden)))}
        )
    )
    (root / "mtp").mkdir()
    (root / "mtp" / "weights.safetensors").write_bytes(
        _safetensors({"mtp.proj": ("F16", [hidden], b"\x00\x3c" * hidden)}, {"kind": "mtp"})
    )
    (root / "mtp" / "notes.txt").write_text("a nested text file\n")
    return root


@pytest.fixture
def repo(hub: HubStandIn, tmp_path: Path) -> tuple[Path, str]:
    (tmp_path / "secret.txt").write_bytes(SECRET)
    folder = _make_repo(tmp_path / "repo")
    (folder / "leak.txt").symlink_to(tmp_path / "secret.txt")  # points outside: must not be served
    return folder, hub.add_repo(REPO, folder)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink()
    }


def test_model_info_gives_sha_sizes_and_lfs(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    folder, sha = repo
    files = _files(folder)
    info = HfApi().model_info(REPO, files_metadata=True)
    assert info.id == REPO and info.sha == sha and info.private is False
    assert {s.rfilename: s.size for s in info.siblings} == {k: len(v) for k, v in files.items()}
    by_name = {s.rfilename: s for s in info.siblings}
    st = by_name["model.safetensors"]
    assert (
        st.lfs is not None
        and st.lfs.sha256 == hashlib.sha256(files["model.safetensors"]).hexdigest()
    )
    assert st.lfs.size == len(files["model.safetensors"])
    assert by_name["config.json"].lfs is None
    assert by_name["config.json"].blob_id == git_blob_sha1(files["config.json"])
    assert info.config == {"model_type": "tiny", "architectures": ["TinyForCausalLM"]}
    assert info.safetensors is not None and info.safetensors.total == 8 + 4

    # by revision name and by commit sha; module-level helpers use the import-time HfApi
    assert HfApi().model_info(REPO, revision="main").sha == sha
    assert huggingface_hub.model_info(REPO, revision=sha).sha == sha
    assert HfApi().model_info(REPO).siblings[0].size is None  # sizes only with files_metadata
    assert sorted(HfApi().list_repo_files(REPO)) == sorted(files)
    assert HfApi().file_exists(REPO, "mtp/weights.safetensors")
    assert not HfApi().file_exists(REPO, "nope.bin")
    refs = HfApi().list_repo_refs(REPO)
    assert [(b.name, b.target_commit) for b in refs.branches] == [("main", sha)]
    assert hub.total_bytes() == 0  # metadata calls move no file bytes


def test_tree_listing_and_pagination(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    folder, sha = repo
    api = HfApi()
    top = {e.path: type(e).__name__ for e in api.list_repo_tree(REPO)}
    assert top == {
        "mtp": "RepoFolder",
        "config.json": "RepoFile",
        "model.safetensors": "RepoFile",
    }
    nested = {e.path for e in api.list_repo_tree(REPO, path_in_repo="mtp", revision=sha)}
    assert nested == {"mtp/weights.safetensors", "mtp/notes.txt"}
    hub.tree_page_size = 2  # force several pages: the client follows Link: rel="next"
    everything = list(api.list_repo_tree(REPO, recursive=True, expand=True))
    assert len(everything) == 5 and all(e.last_commit.oid == sha for e in everything)
    assert sum(1 for m, p, _ in hub.requests if "/tree/" in p and "cursor=" in p) == 2
    infos = api.get_paths_info(REPO, ["config.json", "mtp", "missing.txt"])
    assert [(type(i).__name__, i.path) for i in infos] == [
        ("RepoFile", "config.json"),
        ("RepoFolder", "mtp"),
    ]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="nowhere"))


def test_hf_hub_download_and_cache(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    folder, sha = repo
    files = _files(folder)
    path = Path(hf_hub_download(REPO, "config.json"))
    assert path.read_bytes() == files["config.json"]
    assert str(path).startswith(constants.HF_HUB_CACHE)  # the fixture's temp cache
    assert path.parent.name == sha
    assert hub.bytes_served == {f"{REPO}/config.json": len(files["config.json"])}

    nested = Path(hf_hub_download(REPO, "mtp/weights.safetensors"))
    assert nested.read_bytes() == files["mtp/weights.safetensors"]
    assert hub.bytes_served[f"{REPO}/mtp/weights.safetensors"] == len(nested.read_bytes())

    hub.reset_counters()
    again = Path(hf_hub_download(REPO, "config.json"))
    assert again == path and hub.total_bytes(REPO) == 0
    assert [m for m, p, _ in hub.requests] == ["HEAD"]  # only the etag check
    assert hf_hub_download(REPO, "config.json", revision=sha) == str(path)
    assert len(hub.requests) == 1  # a commit sha that is cached needs no call at all


def test_get_hf_file_metadata(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    folder, sha = repo
    files = _files(folder)
    meta = get_hf_file_metadata(hf_hub_url(REPO, "model.safetensors"))
    assert meta.size == len(files["model.safetensors"])
    assert meta.etag == hashlib.sha256(files["model.safetensors"]).hexdigest()  # LFS: sha256
    assert meta.commit_hash == sha
    small = get_hf_file_metadata(hf_hub_url(REPO, "mtp/notes.txt", revision=sha))
    assert small.etag == git_blob_sha1(files["mtp/notes.txt"]) and small.size == 19
    assert hub.total_bytes() == 0  # HEAD answers carry no body


def test_ranged_reads(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    folder, sha = repo
    data = (folder / "model.safetensors").read_bytes()
    key = f"{REPO}/model.safetensors"

    assert read_range(REPO, "model.safetensors", 0, 8) == data[:8]
    assert hub.bytes_served == {key: 8}
    assert hub.requests[-1][2]["range"] == "bytes=0-7"

    (n,) = struct.unpack("<Q", data[:8])
    header = read_range(REPO, "model.safetensors", 8, 8 + n, revision=sha)
    assert json.loads(header)["w"]["shape"] == [2, 4]
    assert hub.bytes_served == {key: 8 + n}

    # the same calls by hand, to check status codes and headers
    url = hf_hub_url(REPO, "model.safetensors")
    session = get_session()
    r = session.get(url, headers={**build_hf_headers(), "Range": "bytes=-4"})
    hf_raise_for_status(r)
    assert r.status_code == 206 and r.content == data[-4:]
    assert r.headers["Content-Range"] == f"bytes {len(data) - 4}-{len(data) - 1}/{len(data)}"
    assert r.headers["Accept-Ranges"] == "bytes" and r.headers["X-Repo-Commit"] == sha
    r = session.get(url, headers={"Range": f"bytes={len(data) - 3}-"})
    assert r.status_code == 206 and r.content == data[-3:]
    r = session.get(url, headers={"Range": "bytes=2-999999"})  # end clipped to the file
    assert r.status_code == 206 and r.content == data[2:]
    r = session.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416 and r.headers["Content-Range"] == f"bytes */{len(data)}"
    with pytest.raises(HfHubHTTPError) as err:
        hf_raise_for_status(r)
    assert err.value.response.status_code == 416

    nested = (folder / "mtp" / "weights.safetensors").read_bytes()
    assert read_range(REPO, "mtp/weights.safetensors", 3, 11) == nested[3:11]
    assert hub.bytes_served[f"{REPO}/mtp/weights.safetensors"] == 8

    # the client's own safetensors header reader works through ranged GETs as well
    meta = HfApi().parse_safetensors_file_metadata(REPO, "mtp/weights.safetensors", revision=sha)
    assert meta.metadata == {"kind": "mtp"} and meta.tensors["mtp.proj"].shape == [4]


def test_snapshot_download_only_json(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    folder, sha = repo
    snap = Path(snapshot_download(REPO, allow_patterns=["*.json"]))
    assert snap.name == sha
    assert sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file()) == [
        "config.json"
    ]
    assert hub.bytes_served == {f"{REPO}/config.json": (folder / "config.json").stat().st_size}
    got = Path(snapshot_download(REPO, revision=sha, allow_patterns=["mtp/*"]))
    assert (got / "mtp" / "notes.txt").read_text() == "a nested text file\n"
    assert f"{REPO}/model.safetensors" not in hub.bytes_served


def test_errors_map_to_client_exceptions(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    api = HfApi()
    with pytest.raises(RepositoryNotFoundError) as err:
        api.model_info("acme/missing")
    assert err.value.response.status_code == 401  # anonymous, like the Hub
    assert err.value.server_message == "Repository not found"
    with pytest.raises(RepositoryNotFoundError) as err:
        HfApi(token="hf_dummy").model_info("acme/missing")
    assert err.value.response.status_code == 404
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/missing", "config.json")
    with pytest.raises(RepositoryNotFoundError):
        list(api.list_repo_tree("single-segment-missing"))

    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="no-such-branch")
    with pytest.raises(RevisionNotFoundError):
        api.list_repo_files(REPO, revision="f" * 40)

    with pytest.raises(RemoteEntryNotFoundError) as err:
        hf_hub_download(REPO, "missing.json")
    assert isinstance(err.value, EntryNotFoundError)
    with pytest.raises(EntryNotFoundError):
        get_hf_file_metadata(hf_hub_url(REPO, "mtp"))  # a folder is not a file
    with pytest.raises(RemoteEntryNotFoundError):
        read_range(REPO, "leak.txt", 0, 8)  # the symlink leading outside is not published
    assert hub.total_bytes() == 0


def _raw(hub: HubStandIn, method: str, path: str) -> tuple[int, bytes]:
    """A request sent byte-for-byte as given (no client-side URL normalisation)."""
    conn = http.client.HTTPConnection("127.0.0.1", int(hub.url.rsplit(":", 1)[1]), timeout=5)
    try:
        conn.putrequest(method, path, skip_host=False, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "path",
    [
        f"/{REPO}/resolve/main/../secret.txt",
        f"/{REPO}/resolve/main/../../secret.txt",
        f"/{REPO}/resolve/main/%2e%2e/secret.txt",
        f"/{REPO}/resolve/main/..%2Fsecret.txt",
        f"/{REPO}/resolve/main/mtp/..%2F..%2Fsecret.txt",
        f"/{REPO}/resolve/main/.%2Fconfig.json",
        f"/{REPO}/resolve/main/mtp%5C..%5C..%5Csecret.txt",
        f"/{REPO}/resolve/..%2F..%2F/secret.txt",
        f"/api/models/{REPO}/tree/main/..%2F..",
        f"/api/models/{REPO}/revision/..",
    ],
)
def test_dot_dot_paths_are_refused(hub: HubStandIn, repo: tuple[Path, str], path: str) -> None:
    for method in ("GET", "HEAD"):
        status, body = _raw(hub, method, path)
        assert status == 400, (method, path, status)
        assert SECRET not in body
    assert hub.total_bytes() == 0


def test_client_sees_bad_paths_as_errors(hub: HubStandIn, repo: tuple[Path, str]) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/%2e%2e/secret.txt"
    r = get_session().get(url)
    with pytest.raises(BadRequestError):
        hf_raise_for_status(r)
    with pytest.raises(ValueError):  # the client itself refuses to build such a download
        hf_hub_download(REPO, "../secret.txt")
    assert hub.total_bytes() == 0


def test_two_revisions_serve_different_content(hub: HubStandIn, tmp_path: Path) -> None:
    v1 = _make_repo(tmp_path / "v1", hidden=4)
    v2 = _make_repo(tmp_path / "v2", hidden=6)
    sha1 = hub.add_repo(REPO, v1)
    sha2 = hub.add_repo(REPO, v2, revision="v2")
    pinned = hub.add_repo(REPO, v1, revision="pinned", commit_sha="ab" * 20)
    assert len({sha1, sha2}) == 2 and pinned == "ab" * 20
    assert hub.add_repo(REPO, v1) == sha1  # deterministic

    api = HfApi()
    assert api.model_info(REPO).sha == sha1
    assert api.model_info(REPO, revision="v2").sha == sha2
    assert api.model_info(REPO, revision=sha2).sha == sha2
    assert api.model_info(REPO, revision="pinned").sha == pinned
    c1 = Path(hf_hub_download(REPO, "config.json"))
    c2 = Path(hf_hub_download(REPO, "config.json", revision="v2"))
    assert json.loads(c1.read_text())["hidden"] == 4 and json.loads(c2.read_text())["hidden"] == 6
    assert c1.parent.name == sha1 and c2.parent.name == sha2
    assert (
        read_range(REPO, "model.safetensors", 0, 8, revision=sha2)
        == v2.joinpath("model.safetensors").read_bytes()[:8]
    )

    # moving a branch publishes a new commit; the old one stays reachable by sha
    assert hub.add_repo(REPO, v2, revision="main") == sha2
    assert api.model_info(REPO, revision="main").sha == sha2
    assert api.model_info(REPO, revision=sha1).sha == sha1
    assert {b.name: b.target_commit for b in api.list_repo_refs(REPO).branches} == {
        "main": sha2,
        "v2": sha2,
        "pinned": pinned,
    }


def test_server_stops_cleanly(tmp_path: Path) -> None:
    with HubStandIn() as server:
        server.add_repo("solo", _make_repo(tmp_path / "solo"))
        port = int(server.url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("HEAD", "/solo/resolve/main/config.json")
        response = conn.getresponse()
        response.read()
        assert response.status == 200 and response.getheader("ETag").startswith('"')
        thread = server._thread  # an idle keep-alive connection stays open across stop()
    assert thread is not None and not thread.is_alive()
    conn.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    server.stop()  # idempotent
