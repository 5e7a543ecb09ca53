"""What adaptive drafting at acceptance 0 costs over plain decoding, by parts, in plain steps.

    DTYPE=float32 LAYERS=4 python bench/acc0_parts.py SHAPE|DIR [REPEATS]

On one decoder with the head (a random model of SHAPE as `mtpkit bench --random` builds it,
or a model directory), interleaved REPEATS times: a plain step (its token read), a drafting
round at depth 1 whose draft is rejected (oracle drafts at acceptance 0: verify, verdict,
the head's step, the rollback), and the head's catch-up over CATCH_UP_AFTER pairs of plain
steps (what keeping the head warm costs while drafting is paused). Medians in ms and over a
plain step; then what a 128- and a 4096-token run at acceptance 0 pays for them under the
schedule of `speculative/adaptive.py`, against `--no-mtp`, with the head kept warm through
the pauses (as before it rested) and resting (a head that never kept a draft, or parked).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mtpkit.bench.shapes import random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.adaptive import FIRST_ROUNDS, AdaptiveDrafting
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.oracle import OracleDrafts
from mtpkit.speculative.proposers import default_proposer
from mtpkit.speculative.proposers.mtp_head import CATCH_UP_AFTER

source = sys.argv[1]
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
if Path(source).is_dir():
    path = Path(source)
else:
    layers = int(os.environ.get("LAYERS", 0)) or None
    path = random_model_dir(source, os.environ.get("DTYPE", "float32"), layers=layers)
m = load_model(path)
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
vocab = int(m.embedding.weight.shape[0])
fake = list(range(5, 5 + 4096))  # the oracle's "reference": every draft wrong either way


def decoder() -> MtpDecoder:
    oracle = OracleDrafts(fake, len(prompt), 0.0, vocab)
    dec = MtpDecoder(m, prompt, depth=1, sampling=SamplingSettings(), adaptive=False,
                     proposer=oracle.proposer(default_proposer(m)))  # fmt: skip
    dec.prefill()
    return dec


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


times: dict[str, list[float]] = {"plain step": [], "round, draft rejected": [], "catch-up": []}
dec = decoder()
for _ in range(3):  # first uses
    dec.plain_step()
    dec.draft_round()
for _ in range(REPEATS):
    times["plain step"].append(statistics.median(timed(dec.plain_step) for _ in range(8)))
    times["round, draft rejected"].append(statistics.median(timed(dec.draft_round) for _ in range(8)))
    head = dec.proposer.inner
    pair = m.embed(mx.array([[5]]))  # a hidden state's shape and dtype
    for _ in range(CATCH_UP_AFTER):  # pairs that wait for the head while drafting is off
        head.pending_hidden.append(pair)
        head.pending_tokens.append(5)
    times["catch-up"].append(timed(head.catch_up))  # it evaluates the head's cache
    dec = decoder()  # the caches as long as the prompt again
    dec.plain_step()
    dec.draft_round()
plain = statistics.median(times["plain step"])
print(f"{path.name}: medians of {REPEATS} (ms; over a plain step)")
for name, values in times.items():
    med = statistics.median(values)
    print(f"  {name:22s} {med * 1e3:8.2f}  {med / plain:5.2f}  range {min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}")
rounds_cost = statistics.median(times["round, draft rejected"]) / plain
catch = statistics.median(times["catch-up"]) / plain
for n in (128, 4096):
    a = AdaptiveDrafting(enabled=True, cost=rounds_cost)
    rounds = steps = 0
    while rounds + steps < n:
        if a.want_draft():
            a.record_round(1)
            rounds += 1
        else:
            a.record_plain(0.0)
            steps += 1
    warm = steps // CATCH_UP_AFTER  # the head kept warm (before 384dd45); resting: none
    for name, catch_ups in (("head kept warm", warm), ("head resting", 0)):
        extra = rounds * (rounds_cost - 1) + catch_ups * catch
        print(f"  {n} tokens, {name}: {rounds} rounds (first {FIRST_ROUNDS}), {catch_ups} "
              f"catch-ups: {extra:.1f} plain steps, {n / (n + extra):.3f} of --no-mtp")  # fmt: skip
