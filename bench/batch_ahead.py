"""Batched decoding's modes in the same interleaved trials, each against stock mlx-lm's
`batch_generate` at the same width (issue 30): rounds built ahead against rounds read before
the next is built (MODES=ahead, the default), or adaptive drafting's policies (MODES=policy).

    python bench/batch_ahead.py SHAPE [TRIALS] [WIDTHS] [ACCEPTANCES] [MAX_TOKENS]
    # e.g. qwen3_5-0.8b 3 4,8 0.8 128   (on the GPU machine, as bench/gpu_bench.sh runs it)

A random bf16-scaled 4-bit model of SHAPE (`bench --random`), 64-token prompts of random ids,
oracle drafts per row at each acceptance, depth 1, every row running MAX_TOKENS. Each trial,
at each width: stock, then MTP with rounds read first (`BatchDecoder(ahead=False)`), then MTP
with rounds built ahead (the default), then both with adaptive drafting; one whole trial
untimed first. MODES=policy: stock again with the main thread pinned to one core (does the
host's scheduling add to the spread?), the decoder taking only plain steps (what adaptive
drafting falls back to), every step a round, adaptive drafting as it judged before this
script's commit (medians of each step's seconds per token) and as it judges now (steady
costs over mean yields, `speculative/batch/adaptive.py`). Prints aggregate decode tok/s and
the speedups over stock, medians [min-max]. LAYERS=N builds only N layers (a quick try on the
CPU, with DTYPE=float32); PROMPT_TOKENS=N makes the prompts N tokens long (a long context:
rounds built ahead roll every KV cache whole each round).
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
from plain_batch_steps import Plain  # noqa: E402

from mtpkit.bench.batch import mtp_batch_run, stock_batch_tps  # noqa: E402
from mtpkit.bench.shapes import random_model_dir  # noqa: E402
from mtpkit.bench.speed import prompt_of_length  # noqa: E402
from mtpkit.runtime.model import load_model  # noqa: E402
from mtpkit.speculative.batch.adaptive import WidthDrafting, WidthTimes  # noqa: E402
from mtpkit.speculative.oracle import OracleDrafts  # noqa: E402


class MedianTimes(WidthTimes):
    """A width's figures judged as before this script's commit: the median of each step's
    own seconds per token."""

    def per_token(self, *, drafting: bool) -> float:
        seconds, tokens = (self.drafting, self.yields) if drafting else (self.plain, self.plain_yields)
        return statistics.median(s / t for s, t in zip(seconds, tokens, strict=True))


class MedianDrafting(WidthDrafting):
    times_kind = MedianTimes


MODE_SETS = {
    "ahead": {
        "read first": dict(ahead=False), "ahead": dict(ahead=True),
        "read first, adaptive": dict(ahead=False, adaptive=True),
        "ahead, adaptive": dict(ahead=True, adaptive=True),
    },
    "policy": {
        "plain only": dict(policy=Plain), "every round": dict(ahead=True),
        "adaptive, medians": dict(policy=MedianDrafting),
        "adaptive, steady": dict(policy=WidthDrafting),
    },
}  # fmt: skip
MODES = MODE_SETS[os.environ.get("MODES") or "ahead"]
PINNED = "stock, pinned" if os.environ.get("MODES") == "policy" else None


def main() -> None:
    shape = sys.argv[1]
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    widths = [int(w) for w in (sys.argv[3] if len(sys.argv) > 3 else "4,8").split(",")]
    accs = [float(a) for a in (sys.argv[4] if len(sys.argv) > 4 else "0.8").split(",")]
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    layers = int(os.environ["LAYERS"]) if os.environ.get("LAYERS") else None  # a quick try
    path = random_model_dir(shape, os.environ.get("DTYPE") or "bfloat16", layers=layers)
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
            if PINNED:
                pinned = pinned_stock_tps(stock_model, stock_tok, batch, n)
                print(f"trial {trial} batch {width} {PINNED}: {pinned:.1f} tok/s (stock {base:.1f})")
                if trial:
                    speedups.setdefault((width, None, PINNED), []).append(pinned / base)
                    rates.setdefault((width, None, PINNED), []).append(pinned)
            for a in accs:
                for mode, kwargs in MODES.items():
                    oracles = [OracleDrafts(refs[i], length, a, vocab, i) for i in range(width)]
                    kwargs = {k: v() if k == "policy" else v for k, v in kwargs.items()}
                    rate, _, plain = mtp_batch_run(m, batch, 1, n, oracles, **kwargs)
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
        s = stock
        print(f"| {width} | | stock | {statistics.median(stock):.1f} | 1.00 (stock {min(s):.1f}-{max(s):.1f} tok/s) |")
        if PINNED:
            s = speedups[(width, None, PINNED)]
            print(f"| {width} | | {PINNED} | {statistics.median(rates[(width, None, PINNED)]):.1f}"
                  f" | {statistics.median(s):.2f} [{min(s):.2f}-{max(s):.2f}] |")  # fmt: skip
        for a in accs:
            for mode in MODES:
                s = speedups[(width, a, mode)]
                print(f"| {width} | {a:g} | {mode} | {statistics.median(rates[(width, a, mode)]):.1f}"
                      f" | **{statistics.median(s):.2f}** [{min(s):.2f}-{max(s):.2f}] |")  # fmt: skip


def pinned_stock_tps(model, tokenizer, batch: list[list[int]], n: int) -> float:
    """Stock's rate with the calling (main) thread pinned to one core, then unpinned."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(allowed)})
    try:
        return stock_batch_tps(model, tokenizer, batch, n)
    finally:
        os.sched_setaffinity(0, allowed)


if __name__ == "__main__":
    main()
