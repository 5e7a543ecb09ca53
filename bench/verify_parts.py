"""What a verify pass costs over a 1-token forward, part by part (one stream, synchronous).

    python bench/verify_parts.py MODEL_DIR [REPEATS] [rows]     # on the GPU machine

Interleaved, at the prompt's position, each undone after it runs (as bench's costs stage):
a 1-token forward; a 2-token forward of mlx-lm's model alone (no snapshots, mlx-lm's own
attention and gated-delta-net path); mtpkit's 2-token verify; the same without the
few-query attention; the same without the gated-delta-net snapshots (the kernel's states).
With `rows`: forwards and verifies of 1 to 4 tokens instead (how a pass grows with its rows).
Medians in ms, and over the 1-token forward; beside each, the host's share before any
evaluation (building the graph).
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
    t0 = time.perf_counter()
    out = m.model(mx.array([[timer.token] * n]), cache=timer.cache)
    built = time.perf_counter() - t0
    mx.eval(out)
    timer.undo(n)
    return built


def verify(n, few=True, states=True):
    with contextlib.ExitStack() as stack:
        if not few:
            stack.enter_context(_patched(model_module, "few_query_attention", contextlib.nullcontext))
        t0 = time.perf_counter()
        v = m.verify(mx.array([timer.token] * n), timer.cache)
        extra = v.snapshots.states if (states and v.snapshots) else []
        built = time.perf_counter() - t0
        mx.eval(v.logits, v.hidden, extra)
    timer.undo(n)
    return built


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
}
if sys.argv[3:] == ["rows"]:
    for n in (2, 3, 4):
        parts[f"mlx-lm forward {n} tokens"] = lambda n=n: plain(n)
        parts[f"verify {n}"] = lambda n=n: verify(n)
        parts[f"verify {n}, states not read"] = lambda n=n: verify(n, states=False)
else:
    parts |= {
        "mlx-lm forward 2 tokens": lambda: plain(2),
        "verify 2": lambda: verify(2),
        "verify 2, mlx-lm attention": lambda: verify(2, few=False),
        "verify 2, states not read": lambda: verify(2, states=False),
    }
for fn in parts.values():
    for _ in range(5):
        fn()
times = {k: [] for k in parts}
builds = {k: [] for k in parts}
for _ in range(N):
    for k, fn in parts.items():
        t0 = time.perf_counter()
        builds[k].append(fn())
        times[k].append(time.perf_counter() - t0)
one = statistics.median(times["forward 1 token"])
for k, v in times.items():
    med, built = statistics.median(v), statistics.median(builds[k])
    print(f"{k:30s} {med * 1e3:7.3f} ms  {med / one:5.2f}  (built in {built * 1e3:6.3f} ms)")
