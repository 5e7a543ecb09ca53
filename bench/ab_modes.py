"""One process, interleaved: how a drafting round is looked ahead (serial, built ahead,
launched ahead) and whether the multi-row matmul routes are used, at oracle acceptances,
against stock mlx-lm's decode in the same trials.

    python bench/ab_modes.py SHAPE [LAYERS] [TRIALS]     # on the GPU machine, as gpu_bench.sh
    python bench/ab_modes.py SHAPE LAYERS TRIALS rows2   # 2-row routes: lm_head-wide vs timed

`rows2`: the decoder's default look-ahead, with the 2-row products (depth 1's verify) routed
as by default (timed only on matrices of >= routing.WIDE_WEIGHTS) or timed on every matrix.
"""

import shutil
import statistics
import sys

from mtpkit.bench.shapes import random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT, mtp_run, stock_run, stock_tokens
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.kernels import routing
from mtpkit.runtime.model import load_model, untapped
from mtpkit.speculative.oracle import OracleDrafts

shape = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else None
trials = int(sys.argv[3]) if len(sys.argv) > 3 else 3
N = int(__import__("os").environ.get("AB_TOKENS", "96"))
path = random_model_dir(shape, "bfloat16", layers=layers)
m = load_model(path)
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
with untapped(m.final_norm):
    reference = stock_tokens(m.model, m.tokenizer, prompt, N + 8)
vocab = m.embedding.weight.shape[0]
ref, tapped, _ = routing._TAPPED.get(id(m.model), (None, [], {}))


def mtp(depth, acceptance, mode, qmv):
    if ref is not None:  # routes off: no layer of this model is swapped in
        routing._TAPPED[id(m.model)] = (ref, tapped if qmv else [], {})
    oracle = OracleDrafts(reference, len(prompt), acceptance, vocab)
    tps, _, _ = mtp_run(m, prompt, depth, N, draft_filter=oracle, pipeline=mode)
    return tps


def stock():
    with untapped(m.final_norm):
        return stock_run(m.model, m.tokenizer, prompt, N)


def rows2(timed_all: bool):
    """The 2-row routes: every matrix timed, or (the default) only lm_head-wide ones."""
    if not ROWS2:  # the first call: time every matrix at 2 rows (a warm-up depth-1 run)
        routing.TIMED_FROM_ROWS = 2
        mtp(1, 0.8, None, True)
        ROWS2.update({k: v for k, v in routing.ROUTES.items() if k[2] == 2})
        routing.TIMED_FROM_ROWS = 3
    for key, kernel in ROWS2.items():
        wide = key[0] * key[1] >= routing.WIDE_WEIGHTS
        routing.ROUTES[key] = kernel if (timed_all or wide) else False


ROWS2: dict = {}
configs = {"stock": stock}
if sys.argv[4:] == ["rows2"]:
    for depth, acc in ((1, 0.0), (1, 0.8), (1, 0.9)):
        for timed_all in (False, True):
            configs[f"d{depth}@{acc} rows2={'all' if timed_all else 'wide'}"] = (
                lambda d=depth, a=acc, t=timed_all: rows2(t) or mtp(d, a, None, True))
else:
    for depth, acc in ((1, 0.0), (1, 0.8), (3, 0.9)):
        for mode in (False, "build"):
            for qmv in (False, True):
                configs[f"d{depth}@{acc} {mode!s:5} qmv={int(qmv)}"] = (
                    lambda d=depth, a=acc, mo=mode, q=qmv: mtp(d, a, mo, q))
for fn in configs.values():  # warm-up (kernel builds, route timings)
    fn()
res = {k: [] for k in configs}
for _ in range(trials):
    base = stock()
    for k, fn in configs.items():
        res[k].append(fn() / base if k != "stock" else base)
for k, v in res.items():
    print(f"{shape} {k:<28} {statistics.median(v):6.2f}  [{min(v):.2f}-{max(v):.2f}]", flush=True)
print(shape, "routes to the kernel:", [k for k, v in routing.routes_summary().items() if v])
if ROWS2:
    print(shape, "2-row routes timed:", {f"{k[0]}x{k[1]}": v for k, v in ROWS2.items()})
shutil.rmtree(path.parent, ignore_errors=True)
