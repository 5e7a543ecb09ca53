"""How a model's own drafting rounds are looked ahead, interleaved against stock mlx-lm in
the same trials: the decoder's default (by the share of fully kept rounds), always launched
ahead, always built ahead only, never; at fixed depths and with adaptive drafting. Real
drafts (the model's head), the bench's default prompt.

    python bench/look_ahead_modes.py MODEL_DIR [TRIALS] [DEPTHS]   # on the GPU machine

Prints, per configuration, the median speedup over stock [range], and from the last trial
the rounds, those looked ahead (of them launched ahead) and those discarded, and the
median host build and wait of its serial rounds (what the default decides by).
"""

import statistics
import sys

from mtpkit.bench.speed import DEFAULT_PROMPT, _mtp_run, _stock_run
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model, untapped

m = load_model(sys.argv[1])
trials = int(sys.argv[2]) if len(sys.argv) > 2 else 5
depths = [int(d) for d in (sys.argv[3] if len(sys.argv) > 3 else "2,3").split(",")]
N = 128
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)


def stock():
    with untapped(m.final_norm):
        return _stock_run(m.model, m.tokenizer, prompt, N)


def mtp(depth, mode, adaptive=False):
    tps, _, decoder = _mtp_run(m, prompt, depth, N, adaptive=adaptive, pipeline=mode)
    s = decoder.stats
    look = decoder.look
    timed = (statistics.median(look.builds) * 1e3, statistics.median(look.waits) * 1e3) if look.builds else None
    LAST[(depth, mode, adaptive)] = (s.rounds, s.pipelined, s.launched_ahead, s.discarded, timed)
    return tps


LAST: dict = {}
configs = {}
for depth in depths:
    for mode in (None, True, "build", False):
        configs[f"d{depth} {mode!s:5}"] = lambda d=depth, mo=mode: mtp(d, mo)
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
    print(f"{k:<16} {statistics.median(v):5.2f} [{min(v):.2f}-{max(v):.2f}]  rounds {rounds} "
          f"ahead {pipelined} (launched {launched}) discarded {discarded}{serial}", flush=True)
