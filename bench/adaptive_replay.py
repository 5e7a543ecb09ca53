"""Which depths adaptive drafting chooses, replayed on any machine with the GPU's cost prior.

    python bench/adaptive_replay.py MODEL_DIR [TOKENS]

Its choices depend only on the counts of kept drafts and the cost prior (a greedy run refines
the prior by the clock only after plain steps), so a CPU replays a GPU's decisions: the model's
own head, then oracle drafts (`mtpkit bench --acceptance`) at 0, 0.6, 0.8 and 0.9, each a
greedy run of TOKENS (default 128) tokens with `generate --mtp`'s default (depth 1-3 chosen).
Prints the drafting rounds at depth 1 / 2 / 3 and the plain steps of each run.
"""

import sys

from mtpkit.bench.oracle import OracleDrafts
from mtpkit.bench.speed import DEFAULT_PROMPT, _mtp_run, _stock_tokens
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model, untapped
from mtpkit.speculative import adaptive

adaptive.COST_PRIORS["cpu"] = adaptive.COST_PRIORS["gpu"]
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
m = load_model(sys.argv[1])
m.tokenizer.eos_token_ids = []
prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
with untapped(m.final_norm):
    reference = _stock_tokens(m.model, m.tokenizer, prompt, tokens + 8)
vocab = m.embedding.weight.shape[0]
for acceptance in (None, 0.0, 0.6, 0.8, 0.9):
    oracle = None if acceptance is None else OracleDrafts(reference, len(prompt), acceptance, vocab)
    _, _, decoder = _mtp_run(m, prompt, adaptive.AUTO_MAX_DEPTH, tokens, True, oracle)
    name = "its own head" if acceptance is None else f"oracle drafts at {acceptance:g}"
    rounds = " / ".join(map(str, decoder.stats.rounds_by_depth[: adaptive.AUTO_MAX_DEPTH]))
    print(f"{name:24} rounds at depth 1 / 2 / 3: {rounds}, plain steps {decoder.stats.plain_steps}")
