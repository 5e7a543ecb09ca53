"""`mtpkit serve` against `mlx_lm.server` on the same model directory: time to first token and
tokens/s per request, with one client and with several at once, ratios in one run.

    .venv/bin/python bench/serve_bench.py                      # the bundled example, converted
    .venv/bin/python bench/serve_bench.py --model DIR --clients 1,4 --requests 8 --max-tokens 256

Both servers run at once (each on a free loopback port) and are called alike: streamed text
completions at temperature 0 with `stream_options.include_usage`, the same prompts (mtpkit's
probe prompts that the example continues at length), the rounds of the two servers
interleaved so that a busy machine slows both alike. Per request: TTFT (request sent -> first
text chunk) and decode tokens/s (completion tokens after the first / time from the first
chunk to the last); per round of concurrent requests: all their tokens / its wall time
(throughput). The medians, mtpkit's over mlx-lm's, and whether the two servers' texts were equal (greedy) are printed,
and written as JSON with `--json FILE`. mlx_lm.server batches concurrent requests; mtpkit
serve decodes one at a time (its queue) unless given `--serve-args "--decode-concurrency N"`,
so by default with several clients the per-request rates compare a batch against a queue.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"
START_TIMEOUT = 600.0
LONG_STARTS = ("import os", "class Stack", "for (int", "SELECT", "Numbers from")


@dataclass
class Sample:
    ttft: float
    tokens: int
    decode_tps: float | None
    text: str


class Server:
    """A server process on a free loopback port, stopped by its PID."""

    def __init__(self, name: str, command: list[str], log: Path, port: int | None) -> None:
        self.name, self.log_path = name, log
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait(port)

    def _wait(self, port: int | None) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited:\n{self.log_path.read_text()}")
            url = f"http://127.0.0.1:{port}" if port else None
            if url is None and (
                m := re.search(r"on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            ):
                url = m.group(1)
            if url is not None:
                try:
                    if httpx.get(url + "/health", timeout=10).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.3)
        self.stop()
        raise SystemExit(f"{self.name} did not start:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first = last = None
    text, tokens = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text += choice["text"]
    first = first or time.perf_counter()
    tokens = tokens if tokens is not None else 0
    span = (last or first) - first
    return Sample(
        first - start, tokens, (tokens - 1) / span if tokens > 1 and span > 0 else None, text
    )


def run_round(
    server: Server, model: str, prompts: list[str], clients: int, max_tokens: int
) -> tuple[list[Sample], float]:
    """The round's samples and its wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        rows = list(
            pool.map(lambda p: one_request(server.url, model, p, max_tokens), prompts[:clients])
        )
    return rows, time.perf_counter() - start


def median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def prompts_for(n: int) -> list[str]:
    """mtpkit's probe prompts that the bundled example continues past 128 tokens (code,
    SQL, a list; its prose prompts end at an EOS within a few tokens), in turn."""
    from mtpkit.core.prompts import BUILTIN_PROMPTS

    long = [p for p in BUILTIN_PROMPTS if p.startswith(LONG_STARTS)]
    return [long[i % len(long)] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="an MLX model directory (default: the bundled example, converted)"
    )
    parser.add_argument("--clients", default="1,4", help="comma-separated client counts")
    parser.add_argument(
        "--requests", type=int, default=8, help="requests per server per client count"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--serve-args", default="", help="extra arguments for mtpkit serve")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    model = args.model
    if model is None:
        from mtpkit.convert.pipeline import convert

        model = str(work / "tiny-mlx")
        convert(str(EXAMPLE), output=model)
    mlx_port = free_port()
    servers = [
        Server("mtpkit", [sys.executable, "-m", "mtpkit", "serve", "--model", model, "--port", "0",
                          "--log-level", "INFO", *args.serve_args.split()], work / "mtpkit.log", None),
        Server("mlx_lm", [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port",
                          str(mlx_port), "--log-level", "WARNING"], work / "mlx_lm.log", mlx_port),
    ]  # fmt: skip
    results: dict[str, dict] = {}
    try:
        for s in servers:  # warm-up: first graphs, caches
            run_round(s, model, prompts_for(1), 1, 16)
        for clients in [int(c) for c in args.clients.split(",")]:
            samples: dict[str, list[Sample]] = {s.name: [] for s in servers}
            walls = {s.name: 0.0 for s in servers}
            done = 0
            while done < args.requests:
                prompts = prompts_for(done + clients)[done:]
                for s in servers:  # interleaved rounds
                    rows, wall = run_round(s, model, prompts, clients, args.max_tokens)
                    samples[s.name] += rows
                    walls[s.name] += wall
                done += clients
            results[f"clients={clients}"] = summarize(samples, walls)
    finally:
        for s in servers:
            s.stop()
    print_table(results, model, args.max_tokens)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def summarize(samples: dict[str, list[Sample]], walls: dict[str, float]) -> dict:
    out: dict = {}
    for name, rows in samples.items():
        out[name] = {
            "ttft_s": median([r.ttft for r in rows]),
            "decode_tps": median([r.decode_tps for r in rows]),
            "throughput_tps": sum(r.tokens for r in rows) / walls[name],
            "tokens": median([float(r.tokens) for r in rows]),
            "requests": len(rows),
        }
    a, b = out["mtpkit"], out["mlx_lm"]
    out["ratio_ttft"] = ratio(a["ttft_s"], b["ttft_s"])
    out["ratio_decode_tps"] = ratio(a["decode_tps"], b["decode_tps"])
    out["ratio_throughput"] = ratio(a["throughput_tps"], b["throughput_tps"])
    pairs = zip(samples["mtpkit"], samples["mlx_lm"], strict=True)
    out["equal_texts"] = sum(x.text == y.text for x, y in pairs)
    return out


def print_table(results: dict, model: str, max_tokens: int) -> None:
    print(f"model: {model}   max_tokens: {max_tokens}   (medians per request)")
    head = f"{'clients':>10} {'server':>8} {'TTFT s':>9} {'decode tok/s':>13} {'all tok/s':>10}"
    print(head + f" {'tokens':>7}")
    for key, r in results.items():
        for name in ("mtpkit", "mlx_lm"):
            row = r[name]
            tps = f"{row['decode_tps']:.1f}" if row["decode_tps"] else "-"
            print(
                f"{key:>10} {name:>8} {row['ttft_s']:9.3f} {tps:>13} "
                f"{row['throughput_tps']:10.1f} {row['tokens']:7.0f}"
            )
        rt, rd, ra = r["ratio_ttft"], r["ratio_decode_tps"], r["ratio_throughput"]
        print(
            f"{key:>10} {'ratio':>8} {rt:9.2f} {rd if rd is None else f'{rd:.2f}':>13} "
            f"{ra:10.2f}   equal texts {r['equal_texts']}/{r['mtpkit']['requests']}"
        )


if __name__ == "__main__":
    main()
