"""Decode rates from the bench's prompt prefilled once and forked (`mtpkit/bench/prefilled.py`)
against a whole prefill per run, interleaved: stock mlx-lm and mtpkit at depth 2.

    python bench/prefill_fork_ab.py MODEL_DIR CONTEXT TRIALS

Prints each mode's median tok/s and its trials. A fork's first write copies what it changes,
so the two must decode at the same rate (only the prefill, which no figure times, is saved).
"""

import statistics
import sys

from mtpkit.bench import speed
from mtpkit.bench.prefilled import Prefilled
from mtpkit.runtime.model import load_model
from mtpkit.speculative.proposers import default_proposer

m = load_model(sys.argv[1])
m.tokenizer.eos_token_ids = []
text = m.tokenizer.encode("The hash table maps keys to values.")
prompt = speed.prompt_of_length(text, int(sys.argv[2]))
stock, tok = speed._stock_load(m)
tok.eos_token_ids = []
prefilled = Prefilled(m, prompt)
res: dict[str, list[float]] = {"whole": [], "forked": [], "mtp whole": [], "mtp forked": []}
speed._stock_run(stock, tok, prompt, 8)  # warm-ups
speed._stock_run(stock, tok, prompt, 8, cache=prefilled.stock_cache(stock))
for _ in range(int(sys.argv[3])):
    with speed.collector_off():
        res["whole"].append(speed._stock_run(stock, tok, prompt, 64))
    cache = prefilled.stock_cache(stock)
    with speed.collector_off():
        res["forked"].append(speed._stock_run(stock, tok, prompt, 64, cache=cache))
    with speed.collector_off():
        res["mtp whole"].append(speed._mtp_run(m, prompt, 2, 64)[0])
    state = prefilled.mtp_state("mtp", lambda: default_proposer(m))
    with speed.collector_off():
        res["mtp forked"].append(speed._mtp_run(m, prompt, 2, 64, state=state)[0])
for name, rates in res.items():
    print(name, round(statistics.median(rates), 1), [round(x) for x in rates])
