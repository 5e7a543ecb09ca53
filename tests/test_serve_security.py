"""Issue 48, the 2026-12-01 audit of the serving surface, as an attacker or a careless client
tries it: one real server (`--api-key`, `--allow-model-paths ROOT`, `--decode-concurrency
2`), raw sockets where a client library would tidy the bytes up. Each test names the defect
it closes; each failed on commit 80184fc.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from mtpkit.core.console import CONTROL
from mtpkit.serve.settings import DEFAULT_MAX_BODY
from tests.serve_process import ServerProcess

KEY = "s3cret-key"
TIMEOUT = 300.0
MSG = [{"role": "user", "content": "hi"}]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model root: a directory without config.json, and a link to one outside."""
    base = tmp_path_factory.mktemp("models")
    (base / "empty").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    (outside / "config.json").write_text("{}")
    (base / "link").symlink_to(outside)
    return base


@pytest.fixture(scope="module")
def server(converted: Path, root: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve-security") / "server.log"
    proc = ServerProcess(
        converted, log, "--api-key", KEY, "--allow-model-paths", str(root),
        "--decode-concurrency", "2", "--chat-template", TEMPLATE,
    )  # fmt: skip
    yield proc
    proc.stop()


def post(server: ServerProcess, path: str, body: object, key: str | None = KEY):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=headers, timeout=TIMEOUT)


def raw(server: ServerProcess, head: bytes, body: bytes = b"", wait: float = 20.0) -> bytes:
    """Send `head` (and `body`) on a fresh connection and read what comes back within
    `wait` seconds: the status line tells whether the server answered without the body."""
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=wait) as sock:
        sock.sendall(head + body)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
                piece = sock.recv(65536)
                if not piece:
                    break
                reply += piece
        except TimeoutError:
            pass
        return reply


def _length(reply: bytes) -> int:
    found = re.search(rb"content-length: (\d+)", reply.split(b"\r\n\r\n", 1)[0], re.I)
    return int(found.group(1)) if found else 0


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else 0


# 2. The key and the body's size are checked before any body is read --------------------


def test_no_key_is_refused_before_the_body_is_read(server) -> None:
    """A 40 MiB body declared but never sent: the 401 comes at once (before: the server
    waited for and parsed the whole body, then said 401)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 41943040\r\n\r\n"
    )
    reply = raw(server, head)
    assert status(reply) == 401, reply[:200]
    assert b'"invalid_api_key"' in reply


def test_a_body_past_the_limit_is_413_declared_or_streamed(server) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n"
    )
    declared = raw(server, head + b"Content-Length: %d\r\n\r\n" % (DEFAULT_MAX_BODY + 1))
    assert status(declared) == 413, declared[:200]
    chunk = b"x" * (1 << 20)
    pieces = [chunk] * (DEFAULT_MAX_BODY // len(chunk)) + [b"x" * 1024]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    streamed = raw(server, head + b"Transfer-Encoding: chunked\r\n\r\n", chunks)
    assert status(streamed) == 413, streamed[:200]
    assert b"larger than" in streamed


def test_a_non_ascii_authorization_header_is_a_401(server) -> None:
    """Before: compare_digest raised on the non-ASCII text, a 500 with a traceback."""
    head = (
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3\xa9\xff\r\n\r\n"
    )
    assert status(raw(server, head)) == 401
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


# 3. Keys checked at start-up; a warning for an open host without one ---------------------


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--api-key", ""], {}, "is empty"),
        ([], {"MTPKIT_API_KEY": ""}, "is empty"),
        (["--api-key", "   "], {}, "is empty"),
        (["--api-key", "clé"], {}, "printable ASCII"),
        (["--chat-template", "{{"], {}, "--chat-template is not a valid Jinja template"),
        (["--allow-model-paths", "/no/such/root"], {}, "no such directory"),
    ],
)
def test_bad_start_up_options_are_one_line(args, env, expected, tmp_path) -> None:
    """Before: an empty key turned authentication off, a non-ASCII one made every request a
    500, `--chat-template '{{'` started and failed at the first chat."""
    result = subprocess.run(
        [sys.executable, "-m", "mtpkit", "serve", "--model", str(tmp_path), "--port", "0",
         *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], lines


def test_an_open_host_without_a_key_is_warned(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mtpkit", "serve", "--model", str(tmp_path / "none"),
         "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MTPKIT_API_KEY": "k"},
    )  # fmt: skip
    assert "without --api-key" not in result.stderr  # a key from the environment counts
    env = {k: v for k, v in os.environ.items() if k != "MTPKIT_API_KEY"}
    result = subprocess.run(
        [sys.executable, "-m", "mtpkit", "serve", "--model", str(tmp_path / "none"),
         "--host", "0.0.0.0", "--port", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    warned = [line for line in result.stderr.splitlines() if "without --api-key" in line]
    assert len(warned) == 1 and "0.0.0.0" in warned[0]


# 1. Request template arguments are template variables ------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                       "{% endfor %}{% endfor %}"},
     {"return_tensors": "np"}, {"tools": [{"type": "function"}]}, {"tokenize": False}],
)  # fmt: skip
def test_chat_template_kwargs_cannot_reach_the_tokenizer_call(server, kwargs) -> None:
    name = next(iter(kwargs))
    r = post(server, "/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert f"`{name}` is not a template variable" in r.json()["error"]["message"]


def test_a_template_variable_still_reaches_the_template(server) -> None:
    body = {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(server, "/v1/chat/completions", body).status_code == 200


# 4. Client text reaches the log escaped; unencodable text is a 4xx -----------------------


def test_escapes_and_lone_surrogates_never_reach_the_log_raw(server) -> None:
    before = server.log_path.read_bytes()
    name = '"\\u001b]0;owned\\u0007\\u001b[2J\\ud800"'
    for path, field in (("/v1/chat/completions", "model"), ("/v1/completions", "prompt")):
        body = '{"messages": [{"role": "user", "content": "hi"}], "prompt": "x", "%s": %s}'
        r = post(server, path, (body % (field, name)).encode())
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert "lone surrogate" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": MSG, "model": "\x1b]0;owned\x07"})
    assert r.status_code == 404 and "\\x1b" in r.json()["error"]["message"]
    httpx.get(server.url + "/v1/%1b%5b2J", timeout=TIMEOUT)  # the access log's path
    time.sleep(0.5)
    added = server.log_path.read_bytes()[len(before) :].decode()
    assert not CONTROL.search(added.replace("\n", "")), added


# 5. --allow-model-paths: confined to its root; refusals say nothing of what exists --------


def test_model_paths_outside_the_root_or_not_models_are_one_404(server, root: Path) -> None:
    names = ["/etc", "/proc/self/cwd", str(root / "empty"), "empty", "link", "../outside",
             str(root / "missing"), "a" * 5000, "x\u0000y"]  # fmt: skip
    messages = set()
    for name in names:
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "model": name})
        assert r.status_code == 404, (name, r.text)
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        message = error["message"]
        assert os.getcwd() not in message and str(root.parent / "outside") not in message
        messages.add(re.sub(r"`[^`]*`", "NAME", message))
    assert len(messages) == 1, messages  # the same answer, whichever path exists


# 6-8. Sampling settings checked once, against the model; unhonoured fields refused -------


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"response_format": {"type": "json_object"}}, "response_format"), ({"best_of": 2},
      "best_of"), ({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"},
      "function_call"), ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
     ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"stop": ""}, "stop"),
     ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p")],
)  # fmt: skip
def test_what_the_server_cannot_honour_is_a_400_naming_it(server, fields, param) -> None:
    """Before: the first eight were dropped by extra="ignore" and answered 200; the seeds were
    a 500 with --decode-concurrency 2; `stop: ""` a 200."""
    body = json.dumps({"prompt": "x", "max_tokens": 2, **fields})
    r = post(server, "/v1/completions", body.encode())
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
        assert param in r.json()["error"]["message"]


def test_neutral_values_of_refused_fields_are_accepted(server) -> None:
    body = {"prompt": "x", "max_tokens": 2, "logit_bias": {}, "response_format": {"type": "text"},
            "best_of": 1, "repetition_penalty": 1.0, "user": "me"}  # fmt: skip
    assert post(server, "/v1/completions", body).status_code == 200


def test_top_k_past_the_vocabulary_keeps_every_token_and_breaks_nothing(server) -> None:
    """top_k 5000 (and 2**63) on a 1024-token model: before, mlx-lm's compiled filter raised
    and left MLX's random state traced, so every later unseeded sampled request was a 500.
    Now it means what it says, every token kept: the answer of top_k 0 with the same seed."""
    body = {"prompt": "def main(argv):", "max_tokens": 6, "temperature": 0.8, "seed": 7}
    plain = post(server, "/v1/completions", {**body, "top_k": 0}).json()["choices"][0]["text"]
    for top_k in (5000, 2**63):
        r = post(server, "/v1/completions", {**body, "top_k": top_k})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain
    unseeded = {k: v for k, v in body.items() if k != "seed"}
    assert post(server, "/v1/completions", unseeded).status_code == 200


def test_max_tokens_past_the_context_ends_there_with_length(server) -> None:
    """4,000 prompt ids + 500 on a 4,096 context: before, decoding ran to position 4,500.
    Now it stops at the context: 96 tokens at most, finish_reason "length" (or "stop")."""
    r = post(server, "/v1/completions", {"prompt": [10] * 4000, "max_tokens": 500})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 4000 and usage["completion_tokens"] <= 96
    if usage["completion_tokens"] == 96:
        assert r.json()["choices"][0]["finish_reason"] == "length"


# The served schema, its documented codes true (schemathesis) ---------------------------


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(server) -> None:
    """Bounded examples per operation over /openapi.json: no 5xx, every status and content
    type documented (before: the schema said 422 where the server answers 400), every body
    as documented. max_tokens is capped at 4 so that an example costs milliseconds."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import CHECKS

    auth = {"Authorization": f"Bearer {KEY}"}
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=auth)
    wanted = {"not_a_server_error", "status_code_conformance", "content_type_conformance",
              "response_schema_conformance"}  # fmt: skip
    checks = [check for check in CHECKS.get_all() if check.__name__ in wanted]
    assert len(checks) == len(wanted)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    for operation in operations:

        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=operation.as_strategy())
        def run(case) -> None:
            if isinstance(case.body, dict):
                for name in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(name), int) and case.body[name] > 4:
                        case.body[name] = 4
            response = case.call(base_url=server.url, headers=auth, timeout=60)
            case.validate_response(response, checks=checks)

        run()


def test_the_server_answers_after_all_of_the_above(server) -> None:
    r = post(server, "/v1/completions", {"prompt": "x =", "max_tokens": 3, "temperature": 0.7})
    assert r.status_code == 200, r.text
    assert "Traceback" not in server.log_path.read_text()
