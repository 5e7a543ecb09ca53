"""What a verify pass costs over a 1-token forward, part by part (one stream, synchronous).

    python bench/verify_parts.py MODEL_DIR [REPEATS]     # on the GPU machine

Interleaved, at the prompt's position, each undone after it runs (as bench's costs stage):
a 1-token forward; a 2-token forward of mlx-lm's model alone (no snapshots, mlx-lm's own
attention and gated-delta-net path); mtpkit's 2-token verify; the same without the
few-query attention; the same without the gated-delta-net snapshots (the kernel's states).
Medians in ms, and over the 1-token forward.
"""

import contextlib
import statistics
import sys
import time

import mlx.core as mx

from mtpkit.bench.costs import _ForwardTimer
from mtpkit.runtime import model as model_module
from mtpkit.runtime.model import load_model

m = load_model(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 200
timer = _ForwardTimer(m, list(range(5, 45)))


def plain(n):
    mx.eval(m.model(mx.array([[timer.token] * n]), cache=timer.cache))
    timer.undo(n)


def verify(n, few=True, states=True):
    with contextlib.ExitStack() as stack:
        if not few:
            stack.enter_context(_patched(model_module, "few_query_attention", contextlib.nullcontext))
        v = m.verify(mx.array([timer.token] * n), timer.cache)
        extra = v.snapshots.states if (states and v.snapshots) else []
        mx.eval(v.logits, v.hidden, extra)
    timer.undo(n)


@contextlib.contextmanager
def _patched(mod, name, value):
    old = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, old)


parts = {
    "forward 1 token": lambda: plain(1),
    "mlx-lm forward 2 tokens": lambda: plain(2),
    "verify 2": lambda: verify(2),
    "verify 2, mlx-lm attention": lambda: verify(2, few=False),
    "verify 2, states not read": lambda: verify(2, states=False),
}
for fn in parts.values():
    for _ in range(5):
        fn()
times = {k: [] for k in parts}
for _ in range(N):
    for k, fn in parts.items():
        t0 = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t0)
one = statistics.median(times["forward 1 token"])
for k, v in times.items():
    med = statistics.median(v)
    print(f"{k:28s} {med * 1e3:7.3f} ms  {med / one:5.2f}")
