"""`GET /metrics`: the server's Prometheus metrics, named as vLLM names its own
(https://docs.vllm.ai/en/latest/design/metrics.html) with mtpkit's prefix, so that a vLLM
dashboard reads them with `vllm:` replaced by `mtpkit:`.

Counted per finished request (a cancelled one counts nowhere): the spec-decode counters
from its `metrics.speculative_decoding`, its usage tokens, its finish reason; timed per
request: time to first token (the request validated -> its first text) and time per output
token (its first text -> its end, over the tokens after the first, vLLM's TPOT), end-to-end;
read when scraped: the requests waiting in the queue and those decoding (the batch's width).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from mtpkit.serve.schemas import Outcome
    from mtpkit.serve.worker import Worker

PREFIX = "mtpkit:"
# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

__all__ = ["CONTENT_TYPE", "RequestTimer", "ServeMetrics"]


class ServeMetrics:
    """The metrics of one server (a registry of its own: several apps in one process, as in
    tests, do not share counts)."""

    def __init__(self, worker: Worker, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        names = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*names, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=self.registry)

        self.drafts = counter("spec_decode_num_drafts", "Drafting rounds (verify passes).")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by position.",
            ("position",),
        )  # fmt: skip
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Completion tokens generated.")
        self.success = counter(
            "request_success", "Requests finished, by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS
        )
        self.tpot = histogram(
            "time_per_output_token_seconds", "Time per output token after the first.",
            TPOT_BUCKETS,
        )  # fmt: skip
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests in the queue.", names,
            registry=self.registry,
        )  # fmt: skip
        running = Gauge(
            PREFIX + "num_requests_running", "Requests decoding (the batch's width).", names,
            registry=self.registry,
        )  # fmt: skip
        waiting.labels(model_name).set_function(worker.jobs.qsize)
        running.labels(model_name).set_function(lambda: _running(worker))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def finished(self, outcome: Outcome, ttft: float, end: float, start: float) -> None:
        model = self.model_name
        usage = outcome.usage
        self.prompt_tokens.labels(model).inc(usage.prompt_tokens)
        self.generation_tokens.labels(model).inc(usage.completion_tokens)
        self.success.labels(model, outcome.finish_reason).inc()
        self.ttft.labels(model).observe(ttft)
        self.e2e.labels(model).observe(end - start)
        if usage.completion_tokens > 1:
            decode = end - start - ttft
            self.tpot.labels(model).observe(decode / (usage.completion_tokens - 1))
        spec = outcome.spec
        if spec is None:
            return
        self.drafts.labels(model).inc(spec.num_spec_steps)
        self.draft_tokens.labels(model).inc(spec.num_draft_tokens)
        self.accepted.labels(model).inc(spec.num_accepted_draft_tokens)
        for position, count in enumerate(spec.accepted_per_position()):
            self.accepted_per_pos.labels(model, str(position)).inc(count)


class RequestTimer:
    """One request's times: started when made, its first text marked, its end recorded."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter()

    def done(self, outcome: Outcome) -> None:
        end = time.perf_counter()
        ttft = (self.first or end) - self.start
        self.metrics.finished(outcome, ttft, end, self.start)


def _running(worker: Worker) -> int:
    # Read from the scraping thread: a dict's length and one attribute, no lock needed.
    return len(worker.active) or int(worker.current is not None)
