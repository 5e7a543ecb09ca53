"""`mtpkit serve` under pressure and stopping: a full queue answers 503 with Retry-After, and
SIGTERM cancels the decode in flight (its stream ends with an error event and `[DONE]`),
answers the waiting request 503 and exits with status 0. A server process of its own."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ServerProcess

TIMEOUT = 600.0
LONG = {"prompt": "def main(argv):", "max_tokens": 3500}


@pytest.fixture(scope="module")
def server(converted: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc = ServerProcess(converted, log, "--queue-size", "1")
    yield proc
    proc.stop()


def test_full_queue_then_sigterm(server: ServerProcess) -> None:
    url = server.url + "/v1/completions"
    streamed: list[str] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line:
                    streamed.append(line)
                    started.set()
        started.set()

    waiting: list[httpx.Response] = []
    decoding = threading.Thread(target=stream)
    decoding.start()
    assert started.wait(TIMEOUT) and streamed, "the first stream never started"
    queued = threading.Thread(
        target=lambda: waiting.append(httpx.post(url, json=LONG, timeout=TIMEOUT))
    )
    queued.start()
    while server.health()["queued"] < 1:  # the second request takes the one slot
        assert queued.is_alive()
    full = httpx.post(url, json=LONG, timeout=TIMEOUT)
    assert full.status_code == 503
    assert full.headers["Retry-After"] == "1"
    assert full.json()["error"]["code"] == "queue_full"

    assert server.terminate() == 0
    decoding.join(TIMEOUT)
    queued.join(TIMEOUT)
    assert streamed[-1] == "data: [DONE]"
    assert '"shutting_down"' in streamed[-2]
    assert waiting[0].status_code == 503
    assert waiting[0].json()["error"]["code"] == "shutting_down"
    log = server.log_path.read_text()
    assert "Traceback" not in log
    assert "stopping on SIGTERM" in log
