"""`mtpkit serve` with `--allow-model-paths`, under pressure and stopping: a request may load
another model directory by path; a full queue answers 503 with Retry-After; SIGTERM cancels
the decode in flight (its stream ends with an error event and `[DONE]`), answers the waiting
request 503 and exits with status 0. A server process of its own."""

from __future__ import annotations

import shutil
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
    root = str(tmp_path_factory.getbasetemp())  # holds every test's tmp_path
    proc = ServerProcess(converted, log, "--queue-size", "1", "--allow-model-paths", root)
    yield proc
    proc.stop()


def test_chat_without_a_template_is_mlx_lm_servers_prompt(
    server: ServerProcess, converted: Path
) -> None:
    """The example's tokenizer has no chat template: the messages become mlx_lm.server's
    plain prompt (its own `convert_chat`), decoded as stock mlx-lm decodes it."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.server import convert_chat

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "def main(argv):"},
    ]
    model, tokenizer = mlx_lm.load(str(converted))
    ids = tokenizer.encode(convert_chat(messages))
    text = "".join(
        r.text for r in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=12)
        if r.finish_reason != "stop"
    )  # fmt: skip
    body = {"messages": messages, "max_tokens": 12}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert r["choices"][0]["message"]["content"] == text
    assert r["usage"]["prompt_tokens"] == len(ids)


def test_a_request_may_load_another_model_by_path(
    server: ServerProcess, converted: Path, tmp_path: Path
) -> None:
    url = server.url + "/v1/completions"
    body = {"prompt": "def main(argv):", "max_tokens": 12}
    served = httpx.post(url, json=body, timeout=TIMEOUT).json()
    other = tmp_path / "other-model"
    shutil.copytree(converted, other)
    loaded = httpx.post(url, json={**body, "model": str(other)}, timeout=TIMEOUT)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["choices"][0]["text"] == served["choices"][0]["text"]
    assert loaded.json()["model"] == str(other)
    missing = httpx.post(url, json={**body, "model": str(tmp_path / "nothing")}, timeout=TIMEOUT)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    again = httpx.post(url, json=body, timeout=TIMEOUT).json()  # the served model again
    assert again["choices"][0]["text"] == served["choices"][0]["text"]


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

    code = server.terminate()
    assert code == 0, server.log_path.read_text()[-4000:]
    decoding.join(TIMEOUT)
    queued.join(TIMEOUT)
    assert streamed[-1] == "data: [DONE]"
    assert '"shutting_down"' in streamed[-2]
    assert waiting[0].status_code == 503
    assert waiting[0].json()["error"]["code"] == "shutting_down"
    log = server.log_path.read_text()
    assert "Traceback" not in log
    assert "stopping on SIGTERM" in log
