"""What a client of `mtpkit serve --decode-concurrency 4` sees of speculative decoding: vLLM's
per-request `metrics.speculative_decoding` beside the `mtp` object, and `/metrics` in
Prometheus' text format, against a real server process called with the real `openai` client
and httpx.

The per-request figures are checked against the response's own `mtp` object and `usage`;
the scraped counters against the sums over every response, read by prometheus_client's own
parser; the server's request times against the clients' own clocks (a server cannot take
longer than its client waited).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_process import ServerProcess

TIMEOUT = 300.0
PROMPTS = ["def main(argv):", "for i in range(10):", "class Parser(object):", "x =", "import os"]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(converted: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve-metrics") / "server.log"
    proc = ServerProcess(converted, log, "--decode-concurrency", "4")
    yield proc
    proc.stop()


def scrape(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics by name and labels (`name{k=v,...}`), the model label left
    out."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def check_spec(spec: dict, mtp: dict, completion_tokens: int) -> None:
    """vLLM's per-request figures agree with the mtp object and with usage."""
    hist = spec["acceptance_histogram"]
    assert spec["num_draft_tokens"] == mtp["drafted"]
    assert spec["num_accepted_draft_tokens"] == mtp["accepted"]
    assert spec["num_spec_tokens"] == mtp["depth"] >= 1
    assert len(hist) == spec["num_spec_tokens"] + 1
    # A batched row may decode plainly throughout (the batch's adaptive policy): no steps.
    steps = spec["num_spec_steps"]
    assert sum(hist) == steps
    assert sum(j * n for j, n in enumerate(hist)) == mtp["accepted"]
    if steps:
        assert spec["mean_acceptance_length"] == pytest.approx(1 + mtp["accepted"] / steps)
    else:
        assert spec["mean_acceptance_length"] is None
    assert spec["draft_acceptance_rate"] == (
        None if mtp["acceptance"] is None else pytest.approx(mtp["acceptance"])
    )
    # Each step adds its kept drafts and one token of its own; only the first token (from
    # the prompt) and plain steps come from elsewhere, so the steps' tokens fit in usage.
    assert sum((j + 1) * n for j, n in enumerate(hist)) <= completion_tokens


def streamed(server: ServerProcess, prompt: str) -> tuple[dict, float, float]:
    """A streamed completion's last usage chunk, the client's time to its first text and
    its whole time."""
    body = {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first, usage_chunk, finish_chunk = None, None, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage_chunk = chunk
            for choice in chunk.get("choices", []):
                if choice["text"] and first is None:
                    first = time.perf_counter() - start
                if choice["finish_reason"]:
                    finish_chunk = chunk
    assert usage_chunk is not None and finish_chunk is not None and first is not None
    # The finish chunk carries the same figures as the usage chunk.
    assert finish_chunk["metrics"] == usage_chunk["metrics"]
    assert finish_chunk["mtp"] == usage_chunk["mtp"]
    return usage_chunk, first, time.perf_counter() - start


def test_spec_fields_and_metrics_agree_with_responses(server: ServerProcess) -> None:
    before = scrape(server)
    assert before["mtpkit:num_requests_running"] == 0
    assert before["mtpkit:num_requests_waiting"] == 0
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT)
    start = time.perf_counter()
    plain = client.completions.create(
        model="default_model", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0
    )
    plain_wall = time.perf_counter() - start
    extra = plain.model_extra
    check_spec(
        extra["metrics"]["speculative_decoding"], extra["mtp"], plain.usage.completion_tokens
    )

    running: list[float] = []
    done = threading.Event()

    def watch() -> None:  # the gauges, read while the batch decodes
        while not done.is_set():
            running.append(scrape(server)["mtpkit:num_requests_running"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(lambda p: streamed(server, p), PROMPTS * 2))
    finally:
        done.set()
        watcher.join()
    server.wait_idle()
    after = scrape(server)

    usages = [plain.usage.model_dump()] + [u["usage"] for u, _, _ in results]
    mtps = [extra["mtp"]] + [u["mtp"] for u, _, _ in results]
    specs = [extra["metrics"]["speculative_decoding"]] + [
        u["metrics"]["speculative_decoding"] for u, _, _ in results
    ]
    for (chunk, _, _), spec in zip(results, specs[1:], strict=True):
        check_spec(spec, chunk["mtp"], chunk["usage"]["completion_tokens"])

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    n = len(usages)
    assert grew("mtpkit:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert grew("mtpkit:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert grew("mtpkit:spec_decode_num_draft_tokens_total") == sum(m["drafted"] for m in mtps)
    assert grew("mtpkit:spec_decode_num_accepted_tokens_total") == sum(m["accepted"] for m in mtps)
    assert grew("mtpkit:spec_decode_num_drafts_total") == sum(s["num_spec_steps"] for s in specs)
    per_pos = sum(grew(f"mtpkit:spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}")
                  for j in range(max(s["num_spec_tokens"] for s in specs)))  # fmt: skip
    assert per_pos == sum(m["accepted"] for m in mtps)
    assert (
        grew("mtpkit:request_success_total{finished_reason=length}")
        + grew("mtpkit:request_success_total{finished_reason=stop}")
        == n
    )
    assert grew("mtpkit:time_to_first_token_seconds_count") == n
    assert grew("mtpkit:e2e_request_latency_seconds_count") == n
    assert grew("mtpkit:time_per_output_token_seconds_count") == sum(
        u["completion_tokens"] > 1 for u in usages
    )
    # The server's clocks start after the request arrived: never longer than the clients'.
    assert grew("mtpkit:time_to_first_token_seconds_sum") <= plain_wall + sum(
        t for _, t, _ in results
    )
    assert grew("mtpkit:e2e_request_latency_seconds_sum") <= plain_wall + sum(
        w for _, _, w in results
    )
    # Five clients at once, four rows at most: the gauge saw a batch, never wider than 4.
    assert 2 <= max(running) <= 4
    assert after["mtpkit:num_requests_running"] == 0
    assert after["mtpkit:num_requests_waiting"] == 0


def test_plain_decoding_sends_no_spec_fields(converted: Path, tmp_path: Path) -> None:
    """--no-mtp: nothing drafted, so no metrics object (as vLLM without a speculative config),
    and the spec-decode counters stay at zero."""
    proc = ServerProcess(converted, tmp_path / "server.log", "--no-mtp")
    try:
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.0}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200
        assert "metrics" not in r.json()
        assert r.json()["mtp"]["drafter"] == "none"
        counts = scrape(proc)
        assert counts["mtpkit:generation_tokens_total"] == r.json()["usage"]["completion_tokens"]
        assert counts.get("mtpkit:spec_decode_num_drafts_total", 0.0) == 0
    finally:
        proc.stop()
