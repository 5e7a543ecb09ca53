"""A conversation's next turn joining a batch, from the prompt cache against prefilled whole.

    .venv/bin/python bench/batch_prompt_cache.py [SHAPE] [PROMPT_TOKENS] [TRIALS] [LAYERS]

On a random model of SHAPE (default qwen3_5-0.8b, LAYERS of its layers, default all), four
requests of PROMPT_TOKENS random tokens each decode 8 tokens together; then each one's next
turn (its prompt, its answer and 32 new tokens) joins a batch, once on an engine whose prompt
cache holds the first turns (`--decode-concurrency` > 1 with `--prompt-cache-size`) and once
on one that keeps none, in interleaved trials. Prints the median time of the four joins (the
prefill each request waits for before its first token) and their ratio, and checks that both
decode the same greedy tokens.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time

import mlx.core as mx

from mtpkit.bench.shapes import random_model_dir
from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch.session import BatchSession
from mtpkit.speculative.session import Engine, Request

ROWS, ANSWER, MORE, NEXT = 4, 8, 32, 2
# MLX computes bfloat16 slowly on a CPU: the GPU is where bench --random uses it.
DTYPE = "float32" if mx.default_device() == mx.cpu else "bfloat16"


def first_turns(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's next turn after the batch decoded its answer (its state left cached)."""
    batch = BatchSession(engine, adaptive=False)
    entries = [batch.add(Request(p, max_tokens=ANSWER)) for p in prompts]
    while batch.entries:
        batch.step()
    vocab = engine.m.embedding.weight.shape[0]
    more = mx.random.randint(0, vocab, (len(prompts), MORE)).tolist()
    return [p + e.row.decoded + m for p, e, m in zip(prompts, entries, more, strict=True)]


def joins(engine: Engine, turns: list[list[int]]) -> tuple[float, list[list[int]], int]:
    """Seconds to join every turn (prefill and first token), their greedy tokens, and the
    prompt tokens the cache held."""
    batch = BatchSession(engine, adaptive=False)
    start = time.perf_counter()
    entries = [batch.add(Request(t, max_tokens=NEXT)) for t in turns]
    mx.eval(batch.decoder.head.ready)
    seconds = time.perf_counter() - start
    while batch.entries:
        batch.step()
    cached = sum(e.stats.cached_tokens for e in entries)
    return seconds, [e.row.tokens for e in entries], cached


def main(shape: str, prompt_tokens: int, trials: int, layers: int | None) -> None:
    path = random_model_dir(shape, DTYPE, layers=layers)
    try:
        m = load_model(path)
        vocab = m.embedding.weight.shape[0]
        mx.random.seed(0)
        timings: dict[str, list[float]] = {"cached": [], "whole": []}
        for trial in range(trials + 1):  # the first, untimed: first-use costs
            prompts = mx.random.randint(0, vocab, (ROWS, prompt_tokens)).tolist()
            cached = Engine(m, mtp=True, prompt_cache_size=2 * ROWS)
            turns = first_turns(cached, prompts)
            whole = Engine(m, mtp=True, prompt_cache_size=0)
            order = ["cached", "whole"] if trial % 2 else ["whole", "cached"]
            results = {}
            for name in order:
                results[name] = joins(cached if name == "cached" else whole, turns)
            assert results["cached"][1] == results["whole"][1], "the two decodes differ"
            assert results["cached"][2] == sum(len(t) - MORE - 1 for t in turns)
            if trial:
                for name in order:
                    timings[name].append(results[name][0])
                print(f"trial {trial}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in timings.items()))
        c, w = statistics.median(timings["cached"]), statistics.median(timings["whole"])
        print(f"{shape}, {ROWS} next turns of {prompt_tokens} + {ANSWER + 1} + {MORE} tokens")
        print(f"joins from the cache {c:.3f} s, prefilled whole {w:.3f} s: {w / c:.1f}x faster")
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        args[0] if args else "qwen3_5-0.8b",
        int(args[1]) if len(args) > 1 else 512,
        int(args[2]) if len(args) > 2 else 3,
        int(args[3]) if len(args) > 3 else None,
    )
