"""Wall time per drafting round with a draft model: stock mlx-lm's `draft_model=` (between the
yields that end its rounds) against mtpkit's `--draft-model` decoder (each `draft_round`),
in interleaved runs on one pair, the same K, greedy; medians and lower quartiles.

    python bench/draft_pair.py /tmp/pair
    python bench/draft_rounds.py /tmp/pair [RUNS] [MAX_TOKENS] [K]
    OLD=/tmp/draft_model_old.py python bench/draft_rounds.py /tmp/pair   # and an older proposer
                        # (git show COMMIT:mtpkit/speculative/proposers/draft_model.py > FILE)
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm

from mtpkit.bench.speed import DEFAULT_PROMPT
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory

root = sys.argv[1]
runs, n, k = (int(sys.argv[i]) if len(sys.argv) > i else d for i, d in ((2, 6), (3, 64), (4, 3)))
model, tok = mlx_lm.load(f"{root}/target")
draft, _ = mlx_lm.load(f"{root}/draft")
tok.eos_token_ids = []
m = load_model(f"{root}/target", with_head=False)
m.tokenizer.eos_token_ids = []
factory = ProposerFactory(m, DrafterChoice(draft_model=f"{root}/draft"))
prompt = encode_prompt(tok, DEFAULT_PROMPT, chat_template=True)
old = None
if os.environ.get("OLD"):
    spec = importlib.util.spec_from_file_location("draft_model_old", os.environ["OLD"])
    old = importlib.util.module_from_spec(spec)
    sys.modules["draft_model_old"] = old
    spec.loader.exec_module(old)


def old_proposer():
    new = factory()
    return old.DraftModelProposer(new.draft, new.vocab, new.step_cost)


stock_r, mine_r, old_r = [], [], []



def stock() -> None:
    last = None
    stream = mlx_lm.stream_generate(model, tok, mx.array(prompt), max_tokens=n,
                                    draft_model=draft, num_draft_tokens=k)  # fmt: skip
    for r in stream:
        if not r.from_draft:  # a round's last token
            now = time.perf_counter()
            if last is not None:
                stock_r.append(now - last)
            last = now


def mine(make=factory, out=mine_r) -> None:
    dec = MtpDecoder(m, prompt, depth=k, sampling=SamplingSettings(), adaptive=False,
                     proposer=make())  # fmt: skip
    inner = dec.draft_round

    def timed(*args, **kwargs):
        start = time.perf_counter()
        confirmed = inner(*args, **kwargs)
        out.append(time.perf_counter() - start)
        return confirmed

    dec.draft_round = timed
    list(dec.tokens(n))


def trial() -> None:
    stock()
    mine()
    if old is not None:
        mine(old_proposer, old_r)


trial()  # first uses
for times in (stock_r, mine_r, old_r):
    times.clear()
for _ in range(runs):
    trial()
for name, times in (("stock draft_model=", stock_r), ("mtpkit --draft-model", mine_r),
                    ("mtpkit, OLD proposer", old_r)):  # fmt: skip
    if times:
        q25 = statistics.quantiles(times, n=4)[0]
        print(f"{name:22s} {len(times)} rounds: median {statistics.median(times) * 1e3:.1f} ms, "
              f"lower quartile {q25 * 1e3:.1f} ms")  # fmt: skip
