"""Where adaptive drafting's batched runs stall on the GPU (issue 30: single trials of `bench
--batch ... adaptive` at 0.05-0.19x stock, a run of ~1.5 s taking 6-20 s, in timed trials
after an untimed one): every step of adaptive runs timed, with its kind, its width and the
head's pending pairs (plain steps' pairs the head catches up on at the next round).

    python bench/adaptive_stalls.py SHAPE [TRIALS] [WIDTH] [ACCEPTANCE] [MAX_TOKENS]

A random bf16-scaled 4-bit model of SHAPE, 64-token prompts of random ids, oracle drafts per
row, depth 1, `BatchDecoder(adaptive=True)`; prints every step slower than STALL_MS (default
100), each trial's rate, and the (kind, width) pairs a trial met that no trial before it had:
a plain step at a width only adaptive drafting's decisions reach (stock and drafting every
round decode a shrinking batch's narrower widths in rounds only) is the suspect of a stall in a
timed trial. LAYERS=N, DTYPE as bench/batch_ahead.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from mtpkit.bench.batch import oracle_hooks  # noqa: E402
from mtpkit.bench.shapes import random_model_dir  # noqa: E402
from mtpkit.bench.speed import collector_off, prompt_of_length  # noqa: E402
from mtpkit.runtime.model import load_model  # noqa: E402
from mtpkit.speculative.batch import BatchDecoder  # noqa: E402
from mtpkit.speculative.oracle import OracleDrafts  # noqa: E402

STALL = float(os.environ.get("STALL_MS") or 100) / 1000


def main() -> None:
    shape = sys.argv[1]
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    acc = float(sys.argv[4]) if len(sys.argv) > 4 else 0.8
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    layers = int(os.environ["LAYERS"]) if os.environ.get("LAYERS") else None
    path = random_model_dir(shape, os.environ.get("DTYPE") or "bfloat16", layers=layers)
    try:
        m = load_model(path)
        stock_model, stock_tok = mlx_lm.load(str(path))
        m.tokenizer.eos_token_ids = []
        vocab = int(m.embedding.weight.shape[0])
        prompts = [prompt_of_length([1], 64, vocab=vocab, seed=i) for i in range(width)]
        refs = [
            [r.token for r in mlx_lm.stream_generate(stock_model, stock_tok, mx.array(p), max_tokens=n + 8)]
            for p in prompts
        ]  # fmt: skip
        seen: set[tuple[str, int]] = set()
        for trial in range(trials + 1):
            oracles = [OracleDrafts(refs[i], 64, acc, vocab, i) for i in range(width)]
            run(m, prompts, oracles, n, trial, seen)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def run(m, prompts: list[list[int]], oracles: list, n: int, trial: int, seen: set) -> None:
    draft_filter, plan = oracle_hooks(oracles)
    decoder = BatchDecoder(m, depth=1, draft_filter=draft_filter, plan=plan, adaptive=True)
    rows = [decoder.add(p, max_tokens=n) for p in prompts]
    steps, stalls, kinds, met = 0, [], {"plain": 0, "round": 0}, set()
    with collector_off():
        start = time.perf_counter()
        while decoder.rows:
            width = len(decoder.rows)
            pending = len(decoder.proposer.pending)
            queued = "plain queued" if decoder._ahead is not None else (
                "round in flight" if decoder._inflight is not None else "nothing queued")
            plain_before = decoder.plain_steps
            t = time.perf_counter()
            decoder.step()
            dt = time.perf_counter() - t
            kind = "plain" if decoder.plain_steps > plain_before else "round"
            kinds[kind] += 1
            met.add((kind, width))
            if dt > STALL:
                stalls.append(f"  step {steps} {kind} width {width} pending {pending} "
                              f"({queued}): {dt * 1000:.0f} ms")  # fmt: skip
            steps += 1
        elapsed = time.perf_counter() - start
    tokens = sum(len(r.tokens) - 1 for r in rows)
    print(f"trial {trial}: {tokens / elapsed:.1f} tok/s, {kinds['round']} rounds, "
          f"{kinds['plain']} plain steps, {len(stalls)} steps over {STALL * 1000:.0f} ms", flush=True)  # fmt: skip
    for line in stalls:
        print(line, flush=True)
    if trial:
        print(f"  new (kind, width) this trial: {sorted(met - seen) or 'none'}", flush=True)
    seen |= met


if __name__ == "__main__":
    main()
