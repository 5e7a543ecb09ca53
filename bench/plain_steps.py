"""Why plain steps after adaptive drafting stops cost more than `--no-mtp`'s: per-token times.

    python bench/plain_steps.py SHAPE|DIR [TRIALS] [MAX_TOKENS]     # on the GPU machine
    DTYPE=float32 LAYERS=4 MODES=stock,nomtp,head-plain,acc0 python bench/plain_steps.py SHAPE 5 48

Interleaved per trial, on one random model of SHAPE (as `mtpkit bench --random`): stock
mlx-lm (its own load), a second stock load (made last: does the order of the loads matter?),
`--no-mtp` (mlx-lm's loop on mtpkit's load), the same with mtpkit's gated-delta-net conv taps
taken off too (`nomtp-bare`: mlx-lm's classes throughout), mtpkit's decoder with no
proposer, the decoder with the head but every step plain (adaptive drafting paused from the
start), and adaptive drafting at oracle acceptance 0 (4 rounds, then plain steps), the last
also with Python's collector off. For each: tok/s over tokens 2..end (mlx-lm's figure), the
median ms between tokens over the last 100, and the three largest gaps with their index.
Then a cProfile of one run of each decoder mode, by own time.
"""

import contextlib
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

from mtpkit.bench.shapes import random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT, stock_load, stock_tokens
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model, untapped
from mtpkit.runtime.rollback.gdn import gated_delta_net
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.oracle import OracleDrafts
from mtpkit.speculative.proposers import default_proposer

shape = sys.argv[1]
TRIALS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
N = int(sys.argv[3]) if len(sys.argv) > 3 else 128
if Path(shape).is_dir():  # a model directory (the bundled example: what the host costs)
    path = Path(shape)
else:
    path = random_model_dir(
        shape, os.environ.get("DTYPE", "bfloat16"), layers=int(os.environ.get("LAYERS", 0)) or None
    )
m = load_model(path)
m.tokenizer.eos_token_ids = []
stock, stock_tok = stock_load(m)
stock_tok.eos_token_ids = []
stock2, stock2_tok = stock_load(m)
stock2_tok.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
reference = stock_tokens(stock, stock_tok, prompt, N + 8)
vocab = int(m.embedding.weight.shape[0])


def lm_times(model, tok):
    out = []
    for _ in mlx_lm.stream_generate(model, tok, mx.array(prompt), max_tokens=N):
        out.append(time.perf_counter())
    return out


@contextlib.contextmanager
def untapped_convs(model):
    """The gated-delta-net conv1d layers back in mlx-lm's own class for the block."""
    with contextlib.ExitStack() as stack:
        for gdn in filter(None, map(gated_delta_net, model.layers)):
            stack.enter_context(untapped(gdn.conv1d))  # any tapped module, not only a norm
        yield


def dec_times(mode):
    proposer, kwargs = None, {}
    if mode != "dec-nohead":
        proposer = default_proposer(m)
    if mode == "acc0":
        proposer = OracleDrafts(reference, len(prompt), 0.0, vocab).proposer(proposer)
    dec = MtpDecoder(
        m, prompt, depth=3, sampling=SamplingSettings(), adaptive=True, choose_depth=True,
        use_mtp=mode != "dec-nohead", proposer=proposer, **kwargs,
    )  # fmt: skip
    if mode == "head-plain":
        dec.adaptive.plain_left = 10**6
    out = [time.perf_counter() for _ in dec.tokens(N)]
    return out, dec


MODES = ["stock", "stock2", "nomtp", "nomtp-bare", "dec-nohead", "head-plain", "acc0", "acc0-nogc"]
if os.environ.get("MODES"):  # a subset, e.g. MODES=stock,nomtp,head-plain,acc0
    MODES = [mode for mode in MODES if mode in os.environ["MODES"].split(",")]


def run(mode):
    if mode == "stock":
        return lm_times(stock, stock_tok), None
    if mode == "stock2":
        return lm_times(stock2, stock2_tok), None
    if mode == "nomtp":
        with untapped(m.final_norm):
            return lm_times(m.model, m.tokenizer), None
    if mode == "nomtp-bare":
        with untapped(m.final_norm), untapped_convs(m.model):
            return lm_times(m.model, m.tokenizer), None
    if mode == "acc0-nogc":
        gc.collect()
        gc.disable()
        try:
            return dec_times("acc0")
        finally:
            gc.enable()
    return dec_times(mode)


for mode in MODES:  # warm up
    run(mode)
results = {mode: [] for mode in MODES}
for trial in range(TRIALS):
    for mode in MODES:
        times, dec = run(mode)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        tps = (len(times) - 1) / (times[-1] - times[0])
        tail = statistics.median(gaps[-100:]) * 1e3
        top = sorted(range(len(gaps)), key=lambda i: -gaps[i])[:3]
        extra = ""
        if dec is not None:
            s = dec.stats
            extra = f" rounds {s.rounds} plain {s.plain_steps} pipelined {s.pipelined}"
        tops = " ".join(f"{gaps[i] * 1e3:.1f}@{i + 1}" for i in top)
        print(f"trial {trial} {mode:11s} {tps:7.1f} tok/s  median {tail:.2f} ms  top {tops}{extra}")
        results[mode].append(tps)
print("medians (tok/s, over stock):")
base = statistics.median(results[MODES[0]])
for mode, values in results.items():
    med = statistics.median(values)
    print(f"  {mode:11s} {med:7.1f}  {med / base:.3f}  range {min(values):.1f}-{max(values):.1f}")

for mode in [mode for mode in ["nomtp", "dec-nohead", "acc0"] if mode in MODES]:
    prof = cProfile.Profile()
    prof.enable()
    run(mode)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(f"== cProfile {mode}")
    print("\n".join(s.getvalue().splitlines()[6:24]))
