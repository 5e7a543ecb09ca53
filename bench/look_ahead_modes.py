"""How a model's own drafting rounds are looked ahead, interleaved against stock mlx-lm in
the same trials: the decoder's default (`speculative/look_ahead.py` decides), always launched
ahead, always built ahead only, never; at fixed depths and with adaptive drafting. Real
drafts (the model's head), the bench's default prompt.

    python bench/look_ahead_modes.py MODEL_DIR [TRIALS] [DEPTHS]   # on the GPU machine
    ACCEPTANCE=0.8,0.9 python bench/look_ahead_modes.py SHAPE [TRIALS] [DEPTHS]

Prints, per configuration, the median speedup over stock [range], and from the last trial
the rounds, those looked ahead (of them launched ahead) and those discarded, and the
median host build and wait of its serial rounds (what the default decides by).
"""

import os
import shutil
import statistics
import sys
from pathlib import Path

from mtpkit.bench.shapes import random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT, mtp_run, stock_run, stock_tokens
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model, untapped
from mtpkit.speculative.oracle import OracleDrafts

random_shape = not Path(sys.argv[1]).is_dir()
path = random_model_dir(sys.argv[1], "bfloat16") if random_shape else Path(sys.argv[1])
m = load_model(path)
trials = int(sys.argv[2]) if len(sys.argv) > 2 else 5
depths = [int(d) for d in (sys.argv[3] if len(sys.argv) > 3 else "2,3").split(",")]
N = 128
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
acceptances = [float(a) for a in os.environ.get("ACCEPTANCE", "0.8,0.9").split(",")] if random_shape else [None]
if random_shape:
    with untapped(m.final_norm):
        reference = stock_tokens(m.model, m.tokenizer, prompt, N + 8)


def stock():
    with untapped(m.final_norm):
        return stock_run(m.model, m.tokenizer, prompt, N)


def mtp(depth, mode, adaptive=False, acceptance=None):
    oracle = None
    if acceptance is not None:
        oracle = OracleDrafts(reference, len(prompt), acceptance, m.embedding.weight.shape[0])
    tps, _, decoder = mtp_run(m, prompt, depth, N, adaptive=adaptive, pipeline=mode, draft_filter=oracle)
    s = decoder.stats
    look = decoder.look
    timed = (statistics.median(look.builds) * 1e3, statistics.median(look.waits) * 1e3) if look.builds else None
    LAST[(depth, mode, adaptive, acceptance)] = (s.rounds, s.pipelined, s.launched_ahead, s.discarded, timed)
    return tps


LAST: dict = {}
configs = {}
for acc in acceptances:
    at = f"@{acc} " if acc is not None else ""
    for depth in depths:
        for mode in (None, True, "build", False):
            configs[f"d{depth} {at}{mode!s:5}"] = lambda d=depth, mo=mode, a=acc: mtp(d, mo, acceptance=a)
if not random_shape:
    for mode in (None, True):
        configs[f"adaptive {mode!s:5}"] = lambda mo=mode: mtp(max(depths), mo, True)
for fn in configs.values():  # warm-up
    fn()
stock()
res = {k: [] for k in configs}
bases = []
for _ in range(trials):
    base = stock()
    bases.append(base)
    for k, fn in configs.items():
        res[k].append(fn() / base)
print(f"stock {statistics.median(bases):.1f} tok/s [{min(bases):.1f}-{max(bases):.1f}]")
for (k, v), stats in zip(res.items(), LAST.values(), strict=True):
    rounds, pipelined, launched, discarded, timed = stats
    serial = f"  serial build {timed[0]:.2f} ms, wait {timed[1]:.2f} ms" if timed else ""
    print(f"{k:<20} {statistics.median(v):5.2f} [{min(v):.2f}-{max(v):.2f}]  rounds {rounds} "
          f"ahead {pipelined} (launched {launched}) discarded {discarded}{serial}", flush=True)
if random_shape:
    shutil.rmtree(path.parent, ignore_errors=True)
