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


def _repo_with(api: HfApi, repo_id: str, files: dict[str, bytes], tmp_path: Path) -> str:
    """A repo of someone's holding `files`; returns its commit."""
    api.create_repo(repo_id)
    for name, data in files.items():
        local = tmp_path / name.replace("/", "_")
        local.write_bytes(data)
        api.upload_file(path_or_fileobj=str(local), path_in_repo=name, repo_id=repo_id)
    return api.model_info(repo_id).sha


def test_a_repo_holding_files_is_refused_before_converting(
    hub: HubStandIn, source: str, tmp_path: Path
) -> None:
    """`--upload-repo` to a repo that holds files (issue 32 item 1, issue 33 item 3): refused
    before the conversion, with or without --force, and the repo keeps its files."""
    api = HfApi()
    before = _repo_with(api, "me/existing", {"notes.md": b"mine\n"}, tmp_path)
    out = tmp_path / "out"
    for extra in ([], ["--force"]):
        result = runner.invoke(
            app, ["convert", source, "-o", str(out), "--upload-repo", "me/existing", *extra]
        )
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [
            "Error: me/existing already holds 1 files (notes.md): pass --replace-repo to "
            "replace them, or choose another --upload-repo"
        ]
        assert not out.exists()
    # --replace-repo replaces only a model or an earlier upload: notes are not one.
    result = runner.invoke(
        app, ["convert", source, "-o", str(out), "--upload-repo", "me/existing", "--replace-repo"]
    )
    assert result.exit_code == 1
    assert "it holds no model (config.json beside weights) and no earlier mtpkit upload" in (
        result.stderr
    )
    assert api.model_info("me/existing").sha == before and not out.exists()


def test_replace_repo_replaces_an_earlier_upload_seen_before_converting(
    hub: HubStandIn, source: str, conversion: Path, tmp_path: Path
) -> None:
    api = HfApi()
    upload(conversion, "org/again", check=False)
    stale = {"model-00009-of-00009.safetensors": b"\0" * 64}
    for name, data in stale.items():
        (tmp_path / "stale").write_bytes(data)
        api.upload_file(
            path_or_fileobj=str(tmp_path / "stale"), path_in_repo=name, repo_id="org/again"
        )
    with pytest.raises(MtpkitError, match="org/again already holds .* pass --replace-repo"):
        upload(conversion, "org/again", check=False)
    published = upload(conversion, "org/again", check=False, replace=True)
    files = api.list_repo_files("org/again")
    assert "model-00009-of-00009.safetensors" not in files and "mtp.safetensors" in files
    assert published["commit"] == api.model_info("org/again").sha


def test_a_repo_changed_after_the_preflight_is_not_overwritten(
    hub: HubStandIn, source: str, conversion: Path, tmp_path: Path
) -> None:
    """The commit's parent is the commit the preflight saw: a file pushed meanwhile is never
    deleted by a replacing upload."""
    from mtpkit.publish.upload import preflight

    api = HfApi()
    upload(conversion, "org/raced", check=False)
    for name in ("model-00009-of-00009.safetensors", "late.txt"):
        if name == "late.txt":  # pushed after the preflight saw the repo
            state = preflight("org/raced", replace=True)
        (tmp_path / name).write_bytes(b"someone's\n")
        api.upload_file(
            path_or_fileobj=str(tmp_path / name), path_in_repo=name, repo_id="org/raced"
        )
    with pytest.raises(MtpkitError, match=r"nothing was published \(.*Precondition"):
        upload(conversion, "org/raced", check=False, replace=True, state=state)
    files = api.list_repo_files("org/raced")
    assert "late.txt" in files and "model-00009-of-00009.safetensors" in files


@pytest.mark.parametrize("extra", [[], ["--replace-repo"]])
def test_an_upload_to_the_source_repo_is_refused(
    hub: HubStandIn, source: str, tmp_path: Path, extra: list[str]
) -> None:
    before = HfApi().model_info(source).sha
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", source, "-o", str(out), "--upload-repo", source, *extra]
    )
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: --upload-repo {source} is the source {source} itself: publishing there would "
        "replace the original checkpoint; choose another --upload-repo"
    ]
    assert not out.exists() and HfApi().model_info(source).sha == before


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (None, "no Hugging Face token to upload with"),
        ("not-a-token", "the Hugging Face token is not valid (401)"),
        ("hf_read_only", "the Hugging Face token is read-only"),
    ],
)
def test_the_token_is_checked_before_converting(
    hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, token, message
) -> None:
    """Issue 32 item 2: a missing or useless token is named before the conversion runs."""
    hub.add_repo("org/tiny", EXAMPLE)
    if token is None:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "org/tiny", "-o", str(out), "--upload-repo", "me/new"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {message}: log in with `hf auth login` (a token that may write) or set HF_TOKEN"
    ]
    assert not out.exists() and "me/new" not in hub._repos


def test_a_failed_upload_leaves_no_repo_and_its_advice_works(
    hub: HubStandIn, source: str, conversion: Path
) -> None:
    """Issue 33 item 20, issue 32 item 2: nothing published, the repo this run created is
    deleted again, and the command the message names publishes the conversion."""
    hub.lfs_puts_before_failure = 1  # the second weights file fails
    args = ["upload", str(conversion), "--upload-repo", "org/half", "--no-check", "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    line = result.stderr.splitlines()[-1]
    assert line.startswith(
        f"Error: uploading {conversion} to org/half failed, nothing was published ("
    )
    assert "Insufficient Storage" in line  # the server's reason, in one line
    retry = f"mtpkit upload {conversion} --upload-repo org/half"
    assert line.endswith(
        f"; the empty repo org/half this run created was deleted; the conversion stays in "
        f"{conversion}: retry with `{retry}`"
    )
    assert "org/half" not in hub._repos

    hub.lfs_puts_before_failure = None  # the retry the message names, check included
    retried = runner.invoke(app, retry.split()[1:] + ["--quiet"])
    assert retried.exit_code == 0, retried.output
    assert retried.stdout.startswith("published org/half at ")
    assert ", check pass, acceptance " in retried.stdout
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


@pytest.mark.parametrize(
    ("stalled", "message"),
    [
        ("whoami", "cannot reach the Hub to check the token: ReadTimeout"),
        ("info", "cannot read the Hub repo org/slow: ReadTimeout"),
        ("create", "uploading {out} to org/slow failed, nothing was published (ReadTimeout"),
        ("commit", "uploading {out} to org/slow failed, nothing was published (ReadTimeout"),
    ],
)
def test_a_hub_that_stops_answering_ends_the_upload(
    hub: HubStandIn,
    source: str,
    conversion: Path,
    monkeypatch: pytest.MonkeyPatch,
    stalled: str,
    message: str,
) -> None:
    """Issue 33 item 9: every request of an upload is bounded (MTPKIT_HUB_TIMEOUT), whichever
    step the Hub stops answering at; nothing is published and no empty repo is left."""
    monkeypatch.setenv("MTPKIT_HUB_TIMEOUT", "1")
    hub.stall = {stalled}
    args = ["upload", str(conversion), "--upload-repo", "org/slow", "--no-check", "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    *progress, line = result.stderr.splitlines()
    assert line.startswith("Error: " + message.format(out=conversion)), line
    assert all(p.startswith("... uploading ") for p in progress)
    assert hub.stalled and set(hub.stalled) == {stalled}
    assert "org/slow" not in hub._repos


def test_sigterm_during_a_stalled_lfs_upload_ends_the_run(
    hub: HubStandIn, source: str, conversion: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33 item 9: SIGTERM while LFS uploads hang (three files: huggingface_hub's thread
    pool) ends the process with the signal's line and code, however long the timeout."""
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.setenv("MTPKIT_HUB_TIMEOUT", "3600")
    hub.stall = {"lfs_put"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpkit", "upload", str(conversion), "--upload-repo", "org/stuck",
         "--no-check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600  # a bound on a busy machine, not a measurement
        while not hub.stalled and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert hub.stalled == ["lfs_put"] * len(hub.stalled) and hub.stalled
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.splitlines()[-1] == "Error: interrupted by SIGTERM"
    assert stdout == ""
    assert "org/stuck" not in hub._repos  # the repo the run created is deleted again


def test_no_upload_progress_bars_when_stderr_is_not_a_terminal(
    hub: HubStandIn, source: str, conversion: Path
) -> None:
    """Issue 32 item 3: a log or a pipe gets no `Upload 3 LFS files` bar (a real process,
    its stderr a pipe)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mtpkit", "upload", str(conversion), "--upload-repo", "org/bars",
         "--no-check"],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("published org/bars at ")
    assert "LFS files" not in proc.stderr and "\r" not in proc.stderr and "it/s" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("... uploading ") and line.endswith(" files to org/bars")


def test_upload_of_a_directory_refuses_its_source_repo_and_links_out(
    hub: HubStandIn, source: str, conversion: Path, tmp_path: Path
) -> None:
    """`mtpkit upload DIR`: the manifest's source repo is never the target (issue 33 item 3),
    and a file linking out of DIR is never published (item 5); both before any request."""
    manifest_path = conversion / "mtp" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["source"]["spec"] = "org/tiny"
    manifest_path.write_text(json.dumps(manifest))
    hub.reset_counters()
    result = runner.invoke(app, ["upload", str(conversion), "--upload-repo", "ORG/Tiny"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: --upload-repo ORG/Tiny is the source org/tiny itself: publishing there would "
        "replace the original checkpoint; choose another --upload-repo"
    ]
    secret = tmp_path / "token"
    secret.write_text("hf_secret\n")
    (conversion / "vocab.txt").symlink_to(secret)
    result = runner.invoke(app, ["upload", "--path", str(conversion), "--repo", "org/leak"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {conversion / 'vocab.txt'} is a link to {secret}, outside the output "
        f"{conversion}: mtpkit copies and publishes no file from outside it; replace the link "
        "with the file itself"
    ]
    assert hub.requests == [] and "org/leak" not in hub._repos


def test_usage_errors_come_before_any_request(hub: HubStandIn, source: str) -> None:
    hub.reset_counters()
    for args in (
        ["convert", source, "--upload-repo", "org/x"],  # no -o
        ["convert", source, "--mtp-only", "-o", "o", "--upload-repo", "org/x"],
        ["convert", source, "-o", "o", "--replace-repo"],  # no --upload-repo
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
    assert hub.requests == []


def test_upload_names_a_missing_or_damaged_directory(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    (bad / "mtp").mkdir(parents=True)
    (bad / "mtp" / "manifest.json").write_text("{")
    cases = [
        (tmp_path / "missing", f"no such directory {tmp_path / 'missing'}: pass the directory "
         "`mtpkit convert` wrote"),
        (bad, f"{bad / 'mtp' / 'manifest.json'} is not valid JSON (JSONDecodeError): convert "
         "again"),
        (tmp_path, f"{tmp_path} has no mtp/manifest.json: only an mtpkit conversion is uploaded"),
    ]  # fmt: skip
    for directory, message in cases:
        result = runner.invoke(app, ["upload", str(directory), "--upload-repo", "org/x"])
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [f"Error: {message}"]


def test_upload_never_overwrites_the_users_own_readme(
    hub: HubStandIn, source: str, conversion: Path
) -> None:
    """Issue 48, 0: a README.md of the user's in DIR was replaced by the model card without a
    word. It is now published as it is and stays on disk byte for byte; mtpkit's own card
    (from an earlier upload) is still rewritten."""
    mine = "# my notes\n\nbenchmarks I ran by hand\n"
    (conversion / "README.md").write_text(mine)
    logged: list[str] = []
    upload(conversion, "org/mine", check=False, log=logged.append)
    assert (conversion / "README.md").read_text() == mine
    assert Path(hf_hub_download("org/mine", "README.md")).read_text() == mine
    assert any("is your own" in line for line in logged)

    (conversion / "README.md").unlink()
    upload(conversion, "org/cards", check=False)
    first = (conversion / "README.md").read_text()
    assert "# org/cards" in first
    upload(conversion, "org/cards-2", check=False)  # the earlier card is mtpkit's: rewritten
    assert "# org/cards-2" in (conversion / "README.md").read_text()
