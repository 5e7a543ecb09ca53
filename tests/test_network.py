"""Network stalls: every Hub request is bounded by huggingface_hub's own timeout variables
(HF_HUB_ETAG_TIMEOUT, HF_HUB_DOWNLOAD_TIMEOUT), then one error line names the endpoint and
the limits. The endpoint here accepts connections and never answers (a dead proxy, a hung
mirror); the commands run as real processes with those variables set, as a user sets them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from tests import hub_server
from tests.hub_server import HubStandIn

hub = hub_server.hub
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """http://127.0.0.1:PORT: accepts every connection, reads nothing, answers nothing."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "org/tiny"],
        ["convert", "org/tiny", "-o", "{tmp}/out"],
        ["generate", "--model", "org/tiny", "-p", "hi", "--max-tokens", "2"],
    ],
    ids=["inspect", "convert", "generate"],
)
def test_a_hub_that_never_answers_is_one_line_in_bounded_time(silent_endpoint, tmp_path, args):
    env = {
        **os.environ,
        "HF_ENDPOINT": silent_endpoint,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_ETAG_TIMEOUT": "1",
        "HF_HUB_DOWNLOAD_TIMEOUT": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "mtpkit", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # a hang fails here instead of stalling the suite
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"Error: org/tiny is neither a local directory nor reachable on the Hub: cannot reach "
        f"the Hub at {silent_endpoint} for org/tiny: no answer within 1s (HF_HUB_ETAG_TIMEOUT) "
        "or 1s (HF_HUB_DOWNLOAD_TIMEOUT) and it is not cached: check the network, raise those "
        "limits, or pass a local directory"
    ]
    assert not (tmp_path / "out").exists()


def test_hub_downloads_draw_no_progress_frames_into_a_log(hub: HubStandIn, converted: Path):
    """stderr is not a terminal (a CI log): no `\\r` frames, only lines."""
    hub.add_repo("acme/tiny-mtp", converted)
    args = ["generate", "--model", "acme/tiny-mtp", "-p", "hi", "--max-tokens", "2", "--mtp"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "acme/tiny-mtp/mtp/weights.safetensors" in hub.bytes_served  # it did download
    assert "\r" not in result.stderr
