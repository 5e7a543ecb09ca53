"""Batched rounds built ahead against rounds read before the next is built (issue 30), in the
same interleaved trials, each against stock mlx-lm's `batch_generate` at the same width.

    python bench/batch_ahead.py SHAPE [TRIALS] [WIDTHS] [ACCEPTANCES] [MAX_TOKENS]
    # e.g. qwen3_5-0.8b 3 4,8 0.8 128   (on the GPU machine, as bench/gpu_bench.sh runs it)

A random bf16-scaled 4-bit model of SHAPE (`bench --random`), 64-token prompts of random ids,
oracle drafts per row at each acceptance, depth 1, every row running MAX_TOKENS. Each trial,
at each width: stock, then MTP with rounds read first (`BatchDecoder(ahead=False)`), then MTP
with rounds built ahead (the default), then both with adaptive drafting; one whole trial
untimed first. Prints aggregate decode tok/s and the speedups over stock, medians [min-max].
LAYERS=N builds only N layers (a quick try on the CPU); PROMPT_TOKENS=N makes the prompts N
tokens long (a long context: rounds built ahead roll every KV cache whole each round).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from mtpkit.bench.batch import mtp_batch_run, stock_batch_tps  # noqa: E402
from mtpkit.bench.oracle import OracleDrafts  # noqa: E402
from mtpkit.bench.shapes import random_model_dir  # noqa: E402
from mtpkit.bench.speed import prompt_of_length  # noqa: E402
from mtpkit.runtime.model import load_model  # noqa: E402

MODES = {"read first": (False, False), "ahead": (True, False),
         "read first, adaptive": (False, True), "ahead, adaptive": (True, True)}  # fmt: skip


def main() -> None:
    shape = sys.argv[1]
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    widths = [int(w) for w in (sys.argv[3] if len(sys.argv) > 3 else "4,8").split(",")]
    accs = [float(a) for a in (sys.argv[4] if len(sys.argv) > 4 else "0.8").split(",")]
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    layers = int(os.environ["LAYERS"]) if os.environ.get("LAYERS") else None  # a quick try
    path = random_model_dir(shape, "bfloat16", layers=layers)
    try:
        run(path, trials, widths, accs, n)
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def run(path: Path, trials: int, widths: list[int], accs: list[float], n: int) -> None:
    m = load_model(path)
    stock_model, stock_tok = mlx_lm.load(str(path))
    m.tokenizer.eos_token_ids = stock_tok.eos_token_ids = []
    vocab = int(m.embedding.weight.shape[0])
    length = int(os.environ.get("PROMPT_TOKENS") or 64)
    prompts = [prompt_of_length([1], length, vocab=vocab, seed=i) for i in range(max(widths))]
    refs = [
        [r.token for r in mlx_lm.stream_generate(stock_model, stock_tok, mx.array(p), max_tokens=n + 8)]
        for p in prompts
    ]  # fmt: skip
    speedups: dict[tuple, list[float]] = {}
    rates: dict[tuple, list[float]] = {}
    for trial in range(trials + 1):  # trial 0: untimed
        for width in widths:
            batch = prompts[:width]
            base = stock_batch_tps(stock_model, stock_tok, batch, n)
            if trial:
                rates.setdefault((width, "stock"), []).append(base)
            for a in accs:
                for mode, (ahead, adaptive) in MODES.items():
                    oracles = [OracleDrafts(refs[i], length, a, vocab, i) for i in range(width)]
                    rate, _, plain = mtp_batch_run(m, batch, 1, n, oracles, adaptive, ahead=ahead)
                    print(f"trial {trial} batch {width} acc {a:g} {mode}: {rate:.1f} tok/s "
                          f"(stock {base:.1f}, plain share {plain:.2f})", flush=True)  # fmt: skip
                    if trial:
                        speedups.setdefault((width, a, mode), []).append(rate / base)
                        rates.setdefault((width, a, mode), []).append(rate)
    print(f"\n{path.name}, {length}-token prompts, {trials} trials, medians [min-max]")
    print("| batch | acceptance | mode | tok/s | over stock |")
    print("|---|---|---|---|---|")
    for width in widths:
        stock = rates[(width, "stock")]
        print(f"| {width} | | stock | {statistics.median(stock):.1f} | 1.00 |")
        for a in accs:
            for mode in MODES:
                s = speedups[(width, a, mode)]
                print(f"| {width} | {a:g} | {mode} | {statistics.median(rates[(width, a, mode)]):.1f}"
                      f" | **{statistics.median(s):.2f}** [{min(s):.2f}-{max(s):.2f}] |")  # fmt: skip


if __name__ == "__main__":
    main()
