"""Where a decoder round's time goes on the GPU: host build vs waiting on the device, stock's
per-token time in a bare loop (synchronous and pipelined), and rounds that keep every draft,
serial and pipelined (the next round queued before this one is read), per depth.

    python bench/profile_round.py SHAPE [N]     # on the GPU machine, as bench/gpu_bench.sh

Prints ms per step, the host's build time and the wait on the device (medians of 3 repeats
of N steps), and the acceptance-1 ceiling each round time allows.
"""

import shutil
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generation_stream

from mtpkit.bench.shapes import random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model, untapped
from mtpkit.speculative.accept import verdict
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings

shape = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 64
d = random_model_dir(shape, "bfloat16")
m = load_model(d)
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
med = statistics.median


def stock_loop(pipelined):
    with untapped(m.final_norm), mx.stream(generation_stream):
        cache = m.make_cache()
        m.model(mx.array(prompt[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        y = mx.array([prompt[-1]])

        def fwd(y):
            return mx.argmax(m.model(y.reshape(1, 1), cache=cache)[:, -1], axis=-1)

        builds = []
        t0 = time.perf_counter()
        nxt = fwd(y)
        mx.async_eval(nxt)
        for _i in range(N):
            if pipelined:
                tb = time.perf_counter()
                nn_ = fwd(nxt)
                mx.async_eval(nn_)
                builds.append(time.perf_counter() - tb)
                nxt.item()
                nxt = nn_
            else:
                tb = time.perf_counter()
                nn_ = fwd(nxt)
                builds.append(time.perf_counter() - tb)
                mx.eval(nn_)
                nxt = nn_
        mx.eval(nxt)
        return (time.perf_counter() - t0) / N, med(builds)


def mtp_rounds(depth, pipelined):
    """Rounds that always keep everything (no rollback): acceptance-1 throughput of a round."""
    dec = MtpDecoder(m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=False)
    with mx.stream(generation_stream):
        dec.prefill()
        builds, waits = [], []
        t0 = time.perf_counter()
        prev = None
        last = mx.array([prompt[-1]], dtype=mx.int32)
        for _i in range(N):
            tb = time.perf_counter()
            proposal = dec.proposer.propose(depth, dec.sampling)
            drafts = proposal.drafts
            v = m.verify(mx.concatenate([last, drafts]), dec.cache)
            packed, followers = verdict(v.logits[0], drafts, None, dec.sampling)
            mx.async_eval(packed)
            out = dec.proposer.after_verify(proposal, v.hidden, followers, launch=True)
            builds.append(time.perf_counter() - tb)
            last = followers[-1:]
            tw = time.perf_counter()
            if pipelined:
                if prev is not None:
                    prev.tolist()
            else:
                packed.tolist()
            waits.append(time.perf_counter() - tw)
            prev = packed
            dec.proposer.assume_kept(out)
        mx.eval(prev)
        return (time.perf_counter() - t0) / N, med(builds), med(waits)


def fwd_only(n):
    """device time of an n-token verify forward alone, back to back with eval."""
    dec = MtpDecoder(m, prompt, depth=1, sampling=SamplingSettings(), adaptive=False)
    with mx.stream(generation_stream):
        dec.prefill()
        ts = []
        for _i in range(20):
            v = m.verify(mx.array([prompt[-1]] * n, dtype=mx.int32), dec.cache)
            t = time.perf_counter()
            mx.eval(v.logits, v.hidden)
            ts.append(time.perf_counter() - t)
            v.rollback(dec.cache, 1)
        return med(ts[5:])


stock_loop(True)
mtp_rounds(1, True)
res = {}
for _rep in range(3):
    for k, fn in [
        ("stock_sync", lambda: stock_loop(False)),
        ("stock_pipe", lambda: stock_loop(True)),
        ("r1_sync", lambda: mtp_rounds(1, False)),
        ("r1_pipe", lambda: mtp_rounds(1, True)),
        ("r2_sync", lambda: mtp_rounds(2, False)),
        ("r2_pipe", lambda: mtp_rounds(2, True)),
        ("r3_pipe", lambda: mtp_rounds(3, True)),
    ]:
        res.setdefault(k, []).append(fn())
for k, v in res.items():
    cols = list(zip(*v, strict=False))
    print(shape, k, " ".join(f"{med(c) * 1e3:.2f}ms" for c in cols), "(per-step, build[, wait])")
print(
    shape,
    "verify-forward eval-only 1/2/3/4 tok:",
    " ".join(f"{fwd_only(n) * 1e3:.2f}" for n in (1, 2, 3, 4)),
)
sp = med([c[0] for c in res["stock_pipe"]])
for k in ("r1_pipe", "r2_pipe", "r3_pipe"):
    dd = int(k[1])
    r = med([c[0] for c in res[k]])
    print(
        shape,
        k,
        f"ceiling at accept 1: {(dd + 1) * sp / r:.2f}x; at 0.8 depth1-ish: {(1 + 0.8) * sp / r if dd == 1 else 0:.2f}x",
    )
shutil.rmtree(d.parent, ignore_errors=True)
