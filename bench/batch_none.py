"""Batched decoding without a drafter (`BatchDecoder(drafts=False)`, what `--no-mtp` and
models without a head batch with) against stock mlx-lm's `batch_generate` (its
`BatchGenerator`) at the same width, on the bundled example: aggregate decode tok/s (tokens
after each row's first over the decoding time, as stock's `generation_tps` counts them),
the median of the trials after the first (a warm-up), alternating the two in each trial.

    PYTHONPATH=. python bench/batch_none.py [--tokens 128] [--trials 4] [--widths 1,4,8,16]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import mlx_lm

from mtpkit.convert.pipeline import convert
from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
PROMPT = "def main(argv):\n    parser = argparse.ArgumentParser()"


def mtpkit_tps(m, rows: list[list[int]], tokens: int) -> float:
    decoder = BatchDecoder(m, depth=0, drafts=False)
    added = [decoder.add(p, max_tokens=tokens) for p in rows]
    start = time.perf_counter()
    while decoder.rows:
        decoder.step()
    elapsed = time.perf_counter() - start
    return sum(len(r.tokens) - 1 for r in added) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--widths", default="1,4,8,16")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp()) / "tiny-qwen3_5-mlx"
    convert(str(EXAMPLE), output=out)
    m = load_model(out, with_head=False)
    model, tokenizer = mlx_lm.load(str(out))
    m.tokenizer.eos_token_ids = tokenizer.eos_token_ids = []  # every row runs --tokens
    prompt = tokenizer.encode(PROMPT)
    gc.disable()
    for width in (int(w) for w in args.widths.split(",")):
        rows = [prompt] * width
        stock, ours = [], []
        for _ in range(args.trials):
            r = mlx_lm.batch_generate(model, tokenizer, rows, max_tokens=args.tokens)
            stock.append(r.stats.generation_tps)
            ours.append(mtpkit_tps(m, rows, args.tokens))
        s, o = statistics.median(stock[1:]), statistics.median(ours[1:])
        print(f"B={width}: stock {s:.0f} tok/s, mtpkit (no drafter) {o:.0f} tok/s, "
              f"ratio {o / s:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
