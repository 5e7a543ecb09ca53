"""Where a drafting round's time goes, stage by stage, against stock mlx-lm's step.

    python bench/profile_stages.py SHAPE [DEPTH] [N]     # on the GPU machine, as gpu_bench.sh

For each stage of an all-kept round (the head's draft chain, the verify pass, the verdict, the
head's step over the verified pairs) and for stock's one-token step: the graph's size (nodes
of `mx.export_to_dot`; MLX's CUDA backend costs roughly per node), the host's build time and
the time of evaluating it alone (host dispatch plus device). Then a cProfile of N pipelined
rounds, by own time, which names the Python functions the host spends a round in.
"""

import cProfile
import io
import pstats
import re
import shutil
import statistics
import sys
import time
from collections import Counter

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mtpkit.bench.shapes import random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.model import load_model, untapped
from mtpkit.speculative.accept import verdict
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings

shape = sys.argv[1]
DEPTH = int(sys.argv[2]) if len(sys.argv) > 2 else 3
N = int(sys.argv[3]) if len(sys.argv) > 3 else 24
med = statistics.median
path = random_model_dir(shape, "bfloat16") if not shape.startswith("/") else None
m = load_model(path or shape)
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)


def nodes(*arrays):
    f = io.StringIO()
    mx.export_to_dot(f, *arrays)
    labels = re.findall(r'label ="([^"]+)"', f.getvalue())
    return len(labels), Counter(labels)


def timed(build):
    """(build seconds, eval seconds, node count, its top kinds) of one stage."""
    t0 = time.perf_counter()
    outs = build()
    t1 = time.perf_counter()
    count, kinds = nodes(*outs)
    t2 = time.perf_counter()
    mx.eval(*outs)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, count, kinds


def stock_stage():
    with untapped(m.final_norm), mx.stream(generation_stream):
        cache = m.make_cache()
        m.model(mx.array(prompt[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        y = mx.array([prompt[-1]])
        rows = []
        for _ in range(N):
            b, e, c, kinds = timed(lambda: [mx.argmax(m.model(y.reshape(1, 1), cache=cache)[:, -1], axis=-1)])
            rows.append((b, e, c))
        return rows, kinds


def round_stages(depth):
    dec = MtpDecoder(m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=False)
    stages = {k: [] for k in ("draft", "verify", "verdict", "queue")}
    kinds = {}
    with mx.stream(generation_stream):
        dec.prefill()
        box = {"last": mx.array([prompt[-1]], dtype=mx.int32)}
        for _ in range(N):

            def draft():
                box["d"] = dec.proposer.propose(depth, dec.sampling).drafts
                return [box["d"]]

            def verify():
                box["v"] = m.verify(mx.concatenate([box["last"], box["d"]]), dec.cache)
                snaps = box["v"].snapshots.states if box["v"].snapshots else []
                flat = [s for st in snaps for s in (st if isinstance(st, list) else [st])]
                return [box["v"].logits, box["v"].hidden, *flat]

            def judge():
                box["p"], box["f"] = verdict(box["v"].logits[0], box["d"], None, dec.sampling)
                return [box["p"], box["f"]]

            def queue():  # the drafter's queue step, unlaunched (few_query_attention: as it)
                dec.proposer.drop_drafts(depth)
                with few_query_attention():
                    box["o"] = dec.m.head(box["v"].hidden, m.embed(box["f"][None]),
                                          dec.proposer.cache, step=0)  # fmt: skip
                return [box["o"]]

            for name, fn in (("draft", draft), ("verify", verify), ("verdict", judge), ("queue", queue)):
                b, e, c, k = timed(fn)
                stages[name].append((b, e, c))
                kinds[name] = k
            box["last"] = box["f"][-1:]
            dec.proposer.assume_kept(box["o"])
    return stages, kinds


def show(name, rows, kinds=None):
    b, e, c = (med(col) for col in zip(*rows, strict=True))
    top = ", ".join(f"{k} {n}" for k, n in kinds.most_common(6)) if kinds else ""
    print(f"{shape} {name:<16} nodes {c:6.0f}  build {b * 1e3:6.2f} ms  eval {e * 1e3:6.2f} ms  [{top}]")
    return b, e, c


def profile_rounds(depth):
    dec = MtpDecoder(m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=False, pipeline=True)
    dec.m.tokenizer.eos_token_ids = []
    it = dec.tokens(N * (depth + 1) + 8)
    next(it)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in it:
        pass
    pr.disable()
    wall = time.perf_counter() - t0
    print(f"{shape} depth {depth}: {dec.stats.rounds} rounds, {wall / max(dec.stats.rounds, 1) * 1e3:.2f} ms a round (profiled)")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
    print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-4000:])


from mtpkit.runtime.kernels import routing  # noqa: E402

rows, kinds = stock_stage()
sb, se, sc = show("stock step", rows, kinds)
for depth in sorted({1, DEPTH}):
    stages, kinds = round_stages(depth)
    tot = [0.0, 0.0, 0.0]
    for name, rows in stages.items():
        for i, x in enumerate(show(f"d{depth} {name}", rows, kinds.get(name))):
            tot[i] += x
    print(f"{shape} d{depth} round total   nodes {tot[2]:6.0f} ({tot[2] / sc:.2f} stock)  build {tot[0] * 1e3:.2f} ms ({tot[0] / sb:.2f})  eval {tot[1] * 1e3:.2f} ms ({tot[1] / se:.2f})")
profile_rounds(DEPTH)
kernel_routes = routing.routes_summary()
print(shape, "qmv routes (kernel):", " ".join(k for k, v in kernel_routes.items() if v) or "none",
      f"of {len(kernel_routes)}")
if path is not None:
    shutil.rmtree(path.parent, ignore_errors=True)
