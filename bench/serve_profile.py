"""Where `mtpkit serve`'s decoding thread spends a round, with C clients at once (issue 44).

    PYTHONPATH=. .venv/bin/python bench/serve_profile.py --model /tmp/tiny-mlx --clients 4
    PYTHONPATH=. .venv/bin/python bench/serve_profile.py --model DIR --clients 16 --top 40

The server runs in this process (its own pieces: `load_engine`, `Worker`, `create_app`,
uvicorn on a thread, a free loopback port), driven by `mtpkit bench --serve`'s client
(`serve_load.run_round`: streamed greedy completions of mixed prompt lengths). After a
warm-up, cProfile runs around each of the decoding thread's joins (`Worker._join`: the
prefill and first events) and rounds (`Worker._batch_round`: the batched round, then the
events delivered), never while it sleeps on the queue. Printed: the busy time by part (the
round's decoding, joins, event delivery, detokenizing, the hand-over to the event loop), the
rounds and their widths, then cProfile's top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time
from collections import Counter
from pathlib import Path

import uvicorn

from mtpkit.bench.serve_load import long_prompt, mixed_prompts, run_round
from mtpkit.serve.app import create_app
from mtpkit.serve.server import bind, load_engine
from mtpkit.serve.settings import ServeSettings
from mtpkit.serve.worker import Worker

# Functions whose cumulative time is each part of the thread's busy time.
PARTS = {
    "batched rounds (BatchSession.step)": ("session.py", "step"),
    "joins (BatchSession.add: prefill, merge)": ("session.py", "add"),
    "event delivery (Worker._deliver)": ("worker.py", "_deliver"),
    "  detokenizing (TextStream.add)": ("text.py", "add"),
    "  hand-over to the event loop (Job.put)": ("worker.py", "put"),
    "  one wake-up a round (Outbox.flush)": ("worker.py", "flush"),
    "answers (worker.outcome)": ("worker.py", "outcome"),
}


class ProfiledWorker(Worker):
    """The worker, cProfile enabled around each join and round; rounds' widths counted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.profile = cProfile.Profile()
        self.on = False
        self.busy = 0.0
        self.widths: Counter[int] = Counter()

    def _timed(self, call, *args) -> None:
        if not self.on:
            return call(*args)
        start = time.perf_counter()
        self.profile.enable()
        try:
            return call(*args)
        finally:
            self.profile.disable()
            self.busy += time.perf_counter() - start

    def _join(self, batch, job) -> None:
        self._timed(super()._join, batch, job)

    def _batch_round(self, batch) -> None:
        if self.on:
            self.widths[len(self.active)] += 1
        self._timed(super()._batch_round, batch)


def serve_in_thread(
    settings: ServeSettings,
) -> tuple[ProfiledWorker, uvicorn.Server, threading.Thread, str]:
    sock = bind(settings.host, 0)
    worker = ProfiledWorker(
        load_engine(settings), capacity=settings.queue_size,
        concurrency=settings.decode_concurrency, adaptive=settings.adaptive,
    )  # fmt: skip
    config = uvicorn.Config(create_app(settings, worker), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    worker.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return worker, server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def report(worker: ProfiledWorker, wall: float, tokens: int, top: int) -> None:
    stats = pstats.Stats(worker.profile)
    rounds = sum(worker.widths.values())
    print(f"wall {wall:.2f} s, {tokens} tokens ({tokens / wall:.1f} tok/s); decoding thread "
          f"busy {worker.busy:.2f} s ({worker.busy / wall:.0%} of the wall)")  # fmt: skip
    widths = ", ".join(f"{w} rows x{n}" for w, n in sorted(worker.widths.items()))
    print(f"{rounds} rounds ({widths}); {worker.busy / max(rounds, 1) * 1e3:.2f} ms busy a round")
    for label, (file, name) in PARTS.items():
        cumulative = sum(
            v[3] for (f, _line, fn), v in stats.stats.items() if f.endswith(file) and fn == name
        )
        calls = sum(
            v[1] for (f, _line, fn), v in stats.stats.items() if f.endswith(file) and fn == name
        )
        print(f"  {label:<45} {cumulative:7.3f} s  {cumulative / max(worker.busy, 1e-9):5.0%}"
              f"  {calls} calls")  # fmt: skip
    out = io.StringIO()
    pstats.Stats(worker.profile, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-tokens", type=int, default=1024)
    parser.add_argument("--no-adaptive", action="store_true")
    parser.add_argument("--depth", type=int, default=None, help="a fixed depth (default: adaptive)")
    parser.add_argument("--no-mtp", action="store_true", help="plain batched decoding")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    settings = ServeSettings(
        model=args.model, port=0, decode_concurrency=args.clients, log_level="WARNING",
        adaptive=not args.no_adaptive, depth=args.depth, mtp=False if args.no_mtp else "auto",
    )  # fmt: skip
    worker, server, thread, url = serve_in_thread(settings)
    late = long_prompt(args.long_prompt_tokens) if args.long_prompt_tokens else None
    run_round(url, args.model, mixed_prompts(args.clients), 16, late)  # warm-up
    worker.on = True
    wall, tokens = 0.0, 0
    for r in range(args.rounds):
        samples, seconds, _errors = run_round(
            url, args.model, mixed_prompts(args.clients, r * args.clients), args.max_tokens, late
        )
        wall += seconds
        tokens += sum(s.tokens for s in samples)
    worker.on = False
    mode = "--no-mtp" if args.no_mtp else f"depth {args.depth or 'adaptive'}"
    print(f"{Path(args.model).name} ({mode}), {args.clients} clients (+1 late long prompt), "
          f"{args.rounds} rounds of {args.max_tokens} tokens")  # fmt: skip
    report(worker, wall, tokens, args.top)
    server.should_exit = True
    thread.join()
    worker.stop()


if __name__ == "__main__":
    main()
