"""`mtpkit convert ... --upload-repo org/name` against the loopback Hub stand-in (issue 20).

The source is itself served by the stand-in, the upload goes through the real huggingface_hub
client (`tests/hub_upload.py` answers it), and the published repo is then checked by
`mtpkit check org/name`, as a user would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.core.errors import MtpkitError
from mtpkit.publish.upload import upload
from tests import hub_server
from tests.hub_server import HubStandIn

hub = hub_server.hub
runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


@pytest.fixture
def source(hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> str:
    """The trained example as the Hub repo `org/tiny`, and a write token for the client."""
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    hub.add_repo("org/tiny", EXAMPLE)
    return "org/tiny"


def test_convert_uploads_a_checked_conversion_with_its_card(
    hub: HubStandIn, source: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", source, "-o", str(out), "--upload-repo", "org/tiny-mlx", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"wrote {out}: qwen3_5, ")
    assert (
        lines[1].startswith("published org/tiny-mlx at ")
        and ", check pass, acceptance " in lines[1]
    )
    assert len(lines) == 2

    api = HfApi()
    local = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted(api.list_repo_files("org/tiny-mlx")) == sorted([".gitattributes", *local])
    assert {"mlx", "mtp", "base_model:org/tiny"} <= set(api.model_info("org/tiny-mlx").tags)

    card = Path(hf_hub_download("org/tiny-mlx", "README.md")).read_text()
    commit = api.model_info(source).sha
    assert f"[org/tiny](https://huggingface.co/org/tiny) at revision `{commit}`" in card
    assert (
        "| norm convention | mlx_gamma (18 zero-centred norms shifted +1 once, in float32) |"
        in card
    )
    assert "| hidden state fed to the head | post_norm |" in card
    assert "`mtp.safetensors` (keys `mtp.*`" in card
    for command in (
        "mlx_lm.generate --model org/tiny-mlx",
        "mtpkit generate --model org/tiny-mlx --mtp",
        "python -m mlx_vlm.generate --model org/tiny-mlx --draft-model org/tiny-mlx --draft-kind mtp",
        "mtplx run --model org/tiny-mlx --mtp",
        "rapid-mlx serve org/tiny-mlx --enable-mtp --mtp-sidecar org/tiny-mlx",
        "vllm-mlx serve org/tiny-mlx --mllm --mllm-draft-model drafter --mllm-draft-kind mtp",
    ):
        assert command in card
    acceptance = lines[1].rsplit("acceptance ", 1)[1]
    assert (
        f"`mtpkit check` verdict before upload: **pass**, greedy acceptance of the head as shipped {acceptance}"
        in card
    )

    checked = runner.invoke(app, ["check", "org/tiny-mlx", "--probe", "--json"])
    assert checked.exit_code == 0, checked.output
    report = json.loads(checked.stdout)
    assert report["verdict"] == "pass" and report["acceptance"] >= 0.5


@pytest.fixture
def conversion(converted: Path, tmp_path: Path) -> Path:
    """A copy of the converted example (an upload writes its card into the directory)."""
    import shutil

    return Path(shutil.copytree(converted, tmp_path / "conversion"))


def test_a_new_upload_replaces_what_the_repo_held(
    hub: HubStandIn, source: str, conversion: Path, tmp_path: Path
) -> None:
    api = HfApi()
    api.create_repo("org/again")
    stale = tmp_path / "stale.safetensors"
    stale.write_bytes(b"\0" * 64)
    api.upload_file(
        path_or_fileobj=str(stale),
        path_in_repo="model-00009-of-00009.safetensors",
        repo_id="org/again",
    )
    published = upload(conversion, "org/again", check=False)
    files = api.list_repo_files("org/again")
    assert "model-00009-of-00009.safetensors" not in files and "mtp.safetensors" in files
    assert published["commit"] == api.model_info("org/again").sha


def test_an_upload_failing_half_way_leaves_nothing_check_would_pass(
    hub: HubStandIn, source: str, conversion: Path
) -> None:
    hub.lfs_puts_before_failure = 1  # the second weights file fails
    with pytest.raises(MtpkitError) as failed:
        upload(conversion, "org/half", check=False)
    assert str(failed.value).startswith(
        f"uploading {conversion} to org/half failed, nothing was published ("
    )
    assert str(failed.value).endswith(
        f"the conversion stays in {conversion}: run the command again to retry"
    )
    assert "Insufficient Storage" in str(failed.value)  # the server's reason, in one line
    assert "\n" not in str(failed.value)
    assert HfApi().list_repo_files("org/half") == [".gitattributes"]
    checked = runner.invoke(app, ["check", "org/half"])
    assert checked.exit_code == 1 and "verdict: pass" not in checked.stdout

    hub.lfs_puts_before_failure = None  # the retry the message suggests
    upload(conversion, "org/half", check=False)
    assert runner.invoke(app, ["check", "org/half"]).exit_code == 0


def test_a_conversion_failing_check_is_not_uploaded(
    hub: HubStandIn, source: str, converted: Path, tmp_path: Path
) -> None:
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(converted, damaged)
    manifest = json.loads((damaged / "mtp" / "manifest.json").read_text())
    manifest["rmsnorm_weight_format"] = "plain"  # qwen3_5 norms are never plain
    (damaged / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        MtpkitError, match=r"fails `mtpkit check` \(manifest: .*nothing was uploaded"
    ):
        upload(damaged, "org/never")
    assert "org/never" not in hub._repos


def test_upload_repo_must_be_a_repo_id(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["convert", str(EXAMPLE), "-o", str(tmp_path / "o"), "--upload-repo", "not a repo"]
    )
    assert result.exit_code == 2
    assert "is not a Hub repo id (org/name)" in result.stderr
    assert not (tmp_path / "o").exists()
