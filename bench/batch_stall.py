"""Where a batched round stalls on the GPU (issue 30: `bench --batch` on qwen3_5-0.8b sat in
its first `BatchDecoder` round past any limit on an H100; issue 31: one stream's bench once sat
in "forward and head costs" on the same shape). Builds (or reuses) a random model, then times,
with a line each, the joins and every batched round (depth 1) at each width, so a stall shows
which step it is in; past LIMIT seconds every thread's stack is written and it exits.

    python bench/batch_stall.py SHAPE LAYERS DIR [WIDTHS] [LIMIT]

MTPKIT_KERNELS=0 runs the same with mtpkit's CUDA kernels off.
"""

from __future__ import annotations

import faulthandler
import sys
import time
from importlib.resources import files
from pathlib import Path

import mlx.core as mx

from mtpkit.bench.shapes import build_random_model
from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder

T0 = time.perf_counter()


def say(what: str) -> None:
    print(f"{time.perf_counter() - T0:8.2f}s {what}", flush=True)


def main() -> None:
    shape, layers, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    widths = [int(w) for w in (sys.argv[4] if len(sys.argv) > 4 else "1,4").split(",")]
    faulthandler.dump_traceback_later(float(sys.argv[5]) if len(sys.argv) > 5 else 120, exit=True)
    if not (out / "config.json").exists():
        tok = Path(str(files("mtpkit") / "examples" / "tiny-qwen3_5"))
        build_random_model(shape, out, dtype="bfloat16", tokenizer_from=tok,
                           overrides={"num_hidden_layers": layers}, progress=say)  # fmt: skip
    m = load_model(out)
    say(f"loaded {shape} ({layers} layers)")
    prompt = list(range(100, 164))
    for width in widths:
        decoder = BatchDecoder(m, depth=1)
        for r in range(width):
            decoder.add([t + r for t in prompt], max_tokens=12)
        say(f"batch {width}: rows joined")
        step = 0
        while decoder.rows:
            t = time.perf_counter()
            decoder.step()
            mx.synchronize()
            step += 1
            say(f"batch {width}: step {step} {1000 * (time.perf_counter() - t):.1f} ms")
    say("done")


if __name__ == "__main__":
    main()
