"""Does MLX's attention cost a one-off build for every new key length? A verify pass attends
T > 1 queries over a key length that grows every round, where stock decoding attends one.

    python bench/sdpa_shapes.py        # on the GPU machine, as gpu_bench.sh (target sdpa)

For head sizes 32 / 128 / 256 (and 192 over 128, MLA's) and queries 1, 2, 4 with a causal
mask given as "causal" or as an array: milliseconds to evaluate `mx.fast.scaled_dot_product_attention`
at 8 key lengths never seen before, and again at one already seen (medians); then the same
for mtpkit's `attention_by_ops` (what a verify pass on CUDA uses, `runtime/kernels/attention.py`).
"""

import statistics
import time

import mlx.core as mx

from mtpkit.runtime.kernels.attention import attention_by_ops

SDPA = mx.fast.scaled_dot_product_attention


def once(attend, q, k, v, mask) -> float:
    t0 = time.perf_counter()
    mx.eval(attend(q, k, v, scale=0.1, mask=mask))
    return (time.perf_counter() - t0) * 1e3


def case(attend, dq: int, dv: int, ql: int, kind: str, start: int) -> tuple[float, float]:
    heads, fresh, seen = 8, [], []
    for kl in range(start, start + 8):
        q = mx.random.normal((1, heads, ql, dq)).astype(mx.bfloat16)
        k = mx.random.normal((1, 2, kl, dq)).astype(mx.bfloat16)
        v = mx.random.normal((1, 2, kl, dv)).astype(mx.bfloat16)
        mask = None
        if ql > 1:
            mask = "causal" if kind == "causal" else mx.tril(
                mx.ones((ql, kl), dtype=mx.bool_), k=kl - ql)
        mx.eval(q, k, v, *([mask] if isinstance(mask, mx.array) else []))
        fresh.append(once(attend, q, k, v, mask))
        seen.append(min(once(attend, q, k, v, mask) for _ in range(3)))
    return statistics.median(fresh), statistics.median(seen)


start = 300
for name, attend in (("mlx", SDPA), ("mtpkit ops", attention_by_ops)):
    for dq, dv in ((32, 32), (128, 128), (256, 256), (192, 128)):
        for ql, kind in ((1, "-"), (2, "causal"), (2, "array"), (4, "causal")):
            start += 17
            fresh, seen = case(attend, dq, dv, ql, kind, start)
            print(f"{name:10} head {dq}/{dv} queries {ql} mask {kind:6}: new key length "
                  f"{fresh:7.2f} ms, seen {seen:6.2f} ms", flush=True)
