"""Plain batched steps: mtpkit's `BatchDecoder` taking only plain steps (what adaptive
drafting falls back to at a width where rounds lose) against stock mlx-lm's `batch_generate`
at the same width, in interleaved trials.

    .venv/bin/python bench/plain_batch_steps.py MODEL_DIR [TRIALS] [WIDTH] [TOKENS]

Prints each trial's aggregate decode tok/s (tokens after each row's first over the decoding
time) and the median ratio: where it is below 1, adaptive drafting at acceptance 0 cannot
reach stock at that width, whatever it decides.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx_lm

from mtpkit.bench.batch import stock_batch_tps
from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder

PROMPTS = ["Create a new event loop. You", "Return the number of", "def f(x):", "hello"]


class Plain:
    """A drafting policy that never drafts: every step is a plain batched step."""

    def want_draft(self, width: int) -> bool:
        return False

    def record(self, *args: object) -> None:
        pass


def plain_tps(m, prompts: list[list[int]], tokens: int) -> float:
    decoder = BatchDecoder(m, depth=1, policy=Plain())
    rows = [decoder.add(p, max_tokens=tokens) for p in prompts]
    start = time.perf_counter()
    while decoder.rows:
        decoder.step()
    return sum(len(r.tokens) - 1 for r in rows) / (time.perf_counter() - start)


def main() -> None:
    model = sys.argv[1]
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    m = load_model(model)
    stock_model, stock_tokenizer = mlx_lm.load(model)
    m.tokenizer.eos_token_ids = stock_tokenizer.eos_token_ids = []  # every row runs `tokens`
    prompts = [m.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(width)]
    stock_batch_tps(stock_model, stock_tokenizer, prompts, 8)  # warm-ups
    plain_tps(m, prompts, 8)
    ratios = []
    for trial in range(trials):
        stock = stock_batch_tps(stock_model, stock_tokenizer, prompts, tokens)
        ours = plain_tps(m, prompts, tokens)
        ratios.append(ours / stock)
        print(f"trial {trial + 1}: stock {stock:.1f} tok/s, plain batched steps {ours:.1f} tok/s")
    print(
        f"batch {width}, {tokens} tokens a row: plain / stock median {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}-{max(ratios):.3f}]"
    )


if __name__ == "__main__":
    main()
