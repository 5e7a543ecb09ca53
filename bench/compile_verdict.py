"""Does `mx.compile` pay for the round's acceptance step? Eager against compiled, interleaved.

    python bench/compile_verdict.py

Times `mtpkit.speculative.accept.greedy_verdict` (log-softmax, argmax, leading matches, one packed
array read back) eager and under `mx.compile` on random logits of the tiny example's and
Qwen3.5's vocabularies at depths 1 and 3; prints medians of interleaved repeats and checks
both give the same verdict. mtpkit's decoder compiles it only if this shows a gain.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpkit.speculative.accept import greedy_verdict  # noqa: E402


def main(repeats: int = 200) -> None:
    compiled = mx.compile(greedy_verdict)
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    for vocab in (1024, 248320):
        for depth in (1, 3):
            logits = mx.random.normal((depth + 1, vocab))
            drafts = mx.array([5] * depth, dtype=mx.int32)
            mx.eval(logits)
            fns = {"eager": greedy_verdict, "compiled": compiled}
            assert compiled(logits, drafts)[0].tolist() == greedy_verdict(logits, drafts)[0].tolist()
            times: dict[str, list[float]] = {k: [] for k in fns}
            for i in range(repeats + 3):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn(logits, drafts)[0].tolist()
                    if i >= 3:  # the first calls trace and warm up
                        times[name].append(time.perf_counter() - t0)
            eager, comp = (statistics.median(times[k]) * 1e6 for k in fns)
            print(
                f"vocab {vocab:6d} depth {depth}: eager {eager:8.0f} us, compiled {comp:8.0f} us,"
                f" compiled/eager {comp / eager:.2f}"
            )


if __name__ == "__main__":
    main()
