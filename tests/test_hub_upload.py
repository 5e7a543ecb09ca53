"""The stand-in's write side (`tests/hub_upload.py`) with the real `huggingface_hub` client."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import HfHubHTTPError

from tests import hub_server
from tests.hub_server import HubStandIn

hub = hub_server.hub


@pytest.fixture
def api(hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> HfApi:
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    return HfApi(endpoint=hub.url)


def _folder(path: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def test_upload_folder_publishes_one_commit(hub: HubStandIn, api: HfApi, tmp_path: Path) -> None:
    folder = _folder(
        tmp_path / "out",
        {
            "config.json": b'{"model_type": "qwen3_5"}',
            "model.safetensors": b"\0" * 4096,
            "mtp/weights.safetensors": b"\1" * 2048,
            "README.md": b"---\ntags:\n- mlx\n- mtp\nbase_model: org/base\n---\n# card\n",
        },
    )
    url = api.create_repo("org/new")
    assert url.repo_id == "org/new"
    info = api.upload_folder(repo_id="org/new", folder_path=folder, commit_message="up")
    files = api.list_repo_files("org/new")
    assert sorted(files) == [
        ".gitattributes",
        "README.md",
        "config.json",
        "model.safetensors",
        "mtp/weights.safetensors",
    ]
    path = hf_hub_download("org/new", "mtp/weights.safetensors", revision=info.oid)
    assert Path(path).read_bytes() == b"\1" * 2048
    model = api.model_info("org/new")
    assert model.sha == info.oid
    assert {"mlx", "mtp", "base_model:org/base"} <= set(model.tags)
    # The same content again is no new commit; a second repo of that name is refused.
    again = api.upload_folder(repo_id="org/new", folder_path=folder)
    assert again.oid == info.oid
    with pytest.raises(HfHubHTTPError):
        api.create_repo("org/new")
    assert api.create_repo("org/new", exist_ok=True).repo_id == "org/new"


def test_writes_need_a_token(hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(HfHubHTTPError) as e:
        HfApi(endpoint=hub.url).create_repo("org/anon", token=False)
    assert e.value.response.status_code == 401


@pytest.mark.parametrize("failure", ["lfs", "commit"])
def test_an_upload_failing_half_way_publishes_nothing(
    hub: HubStandIn, api: HfApi, tmp_path: Path, failure: str
) -> None:
    folder = _folder(
        tmp_path / "out",
        {f"model-{i}.safetensors": bytes([i]) * 1024 for i in range(3)} | {"config.json": b"{}"},
    )
    api.create_repo("org/half")
    before = api.list_repo_files("org/half")
    if failure == "lfs":
        hub.lfs_puts_before_failure = 1  # the second LFS object fails
    else:
        hub.fail_commits = True
    with pytest.raises((HfHubHTTPError, RuntimeError)):
        api.upload_folder(repo_id="org/half", folder_path=folder)
    huggingface_hub.close_session()
    assert api.list_repo_files("org/half") == before == [".gitattributes"]
