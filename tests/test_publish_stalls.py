"""`convert --upload-repo` against a Hub that stops answering part way: each request is bounded
(MTPKIT_HUB_TIMEOUT), SIGTERM ends the run at once, and what the user is told matches what
the Hub holds. The reference is the loopback stand-in's own state (`tests/hub_upload.py`),
reached through the real huggingface_hub client.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from tests import hub_server
from tests.hub_server import HubStandIn

hub = hub_server.hub  # the fixture
runner = CliRunner()
EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
LIMIT = 120  # seconds: a bound on a busy machine, not a measurement


@pytest.fixture
def source(hub: HubStandIn, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in_token")
    hub.add_repo("org/tiny", EXAMPLE)
    return "org/tiny"


def head_files(hub: HubStandIn, repo_id: str) -> set[str]:
    """The files at the head of `repo_id`'s main branch, as the stand-in holds them."""
    repo = hub._repos[repo_id]
    return set(repo.commits[repo.refs["main"]].files)


def convert_args(source: str, out: Path, repo: str) -> list[str]:
    return ["convert", source, "-o", str(out), "--upload-repo", repo]


def test_a_hub_silent_after_taking_the_commit_leaves_it_and_says_so(
    hub: HubStandIn, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub applies the commit and answers nothing from then on. The run used to say
    "nothing was published" and try to delete the repo it created (its upload inside);
    now it ends after the bounded requests with one line saying the commit may be there,
    and leaves the repo, which holds the whole upload."""
    monkeypatch.setenv("MTPKIT_HUB_TIMEOUT", "1")
    hub.silent_after = "commit"
    out = tmp_path / "o"
    result = runner.invoke(app, convert_args(source, out, "org/silent"))
    assert result.exit_code == 1, result.output
    line = result.stderr.splitlines()[-1]
    assert line.startswith(
        f"Error: uploading {out} to org/silent: the Hub did not answer the commit (ReadTimeout"
    ), line
    assert "and may have applied it: look at " in line and "nothing was published" not in line
    assert f"retry with `mtpkit upload {out} --upload-repo org/silent`" in line
    assert "delete" not in hub.stalled  # no deletion was tried
    assert {"config.json", "mtp/manifest.json", "README.md"} <= head_files(hub, "org/silent")


def test_a_commit_whose_answer_is_lost_is_reported_published(
    hub: HubStandIn, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub applies the commit, its answer is lost, later requests are answered: the run
    reads the repo's head, finds its files there, and reports the commit published (it used
    to delete the repo it had just published)."""
    monkeypatch.setenv("MTPKIT_HUB_TIMEOUT", "1")
    hub.silent_after, hub.stays_silent = "commit", False
    result = runner.invoke(app, [*convert_args(source, tmp_path / "o", "org/lost"), "--json"])
    assert result.exit_code == 0, result.output
    assert (
        "... the Hub did not answer the commit, but org/lost holds it: published"
        in result.stderr.splitlines()
    )
    published = json.loads(result.stdout)["upload"]
    repo = hub._repos["org/lost"]
    assert published["commit"] == repo.refs["main"]
    assert published["url"].endswith(f"/org/lost/commit/{repo.refs['main']}")
    assert "mtp/manifest.json" in head_files(hub, "org/lost")


def test_sigterm_while_a_put_stalls_ends_convert_at_once(
    hub: HubStandIn, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`convert --upload-repo` with LFS PUTs that never answer and the default request limit
    (minutes): SIGTERM ends it within seconds with the signal's line and 143, and nothing is
    published: the repo the run created is deleted again, the conversion stays."""
    hub.stall = {"lfs_put"}
    out = tmp_path / "o"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpkit", *convert_args(source, out, "org/stuck")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + LIMIT
        while not hub.stalled and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hub.stalled and set(hub.stalled) == {"lfs_put"}, proc.poll()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    lines = stderr.splitlines()
    assert lines[-1] == "Error: interrupted by SIGTERM", stderr
    assert [line for line in lines if line.startswith("Error")] == [lines[-1]]
    assert "Traceback" not in stderr and stdout == ""
    assert "org/stuck" not in hub._repos
    assert (out / "mtp" / "manifest.json").is_file()
