"""What prompt lookup costs where it finds nothing, and gains where text repeats (CPU or GPU).

    .venv/bin/python bench/prompt_lookup_cost.py [MODEL_DIR] [TRIALS]

Interleaved trials on one loaded model: plain decoding (`generate --no-mtp`'s decoder path)
against `--prompt-lookup` (adaptive drafting, generate's default), on a prompt of random
token ids (nothing to look up unless the output repeats itself), on a repetitive prompt, and
with n-grams too long to ever match (each step searches and finds nothing: the lookup's cost).
Prints medians of decode tok/s and their ratio per prompt, and the rounds lookup drafted.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtpkit.runtime.model import load_model  # noqa: E402
from mtpkit.speculative.accept import SamplingSettings  # noqa: E402
from mtpkit.speculative.decode import MtpDecoder  # noqa: E402
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory  # noqa: E402

TOKENS = 128


def rate(m, prompt: list[int], proposer) -> tuple[float, int]:
    decoder = MtpDecoder(m, prompt, depth=3, sampling=SamplingSettings(), adaptive=True,
                         choose_depth=True, use_mtp=proposer is not None, proposer=proposer)  # fmt: skip
    n, t0 = 0, None
    for _ in decoder.tokens(TOKENS):
        n += 1
        if t0 is None:
            t0 = time.perf_counter()  # the first token's time is the prompt's
    return (n - 1) / (time.perf_counter() - t0), decoder.stats.rounds


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "tiny-mlx")
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    m = load_model(model, with_head=False)
    m.tokenizer.eos_token_ids = []  # every run decodes TOKENS tokens
    lookup = ProposerFactory(m, DrafterChoice(prompt_lookup=True))
    # n-grams of 64 tokens never recur here: every step searches and finds nothing.
    never = ProposerFactory(m, DrafterChoice(prompt_lookup=True, prompt_lookup_min=64,
                                             prompt_lookup_max=64))  # fmt: skip
    vocab = m.embedding.weight.shape[0]
    rng = random.Random(0)
    prompts = {
        "random ids": [rng.randrange(3, vocab) for _ in range(256)],
        "repetitive": m.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"),
    }
    print(f"{model}: {TOKENS} tokens per run, {trials} interleaved trials, medians")
    cases = [(name, prompt, lookup) for name, prompt in prompts.items()]
    cases.append(("no match", prompts["random ids"], never))
    for name, prompt, factory in cases:
        rate(m, prompt, None), rate(m, prompt, factory())  # warm up
        plain, looked, rounds = [], [], []
        for _ in range(trials):
            plain.append(rate(m, prompt, None)[0])
            r, n = rate(m, prompt, factory())
            looked.append(r)
            rounds.append(n)
        ratio = statistics.median(b / a for a, b in zip(plain, looked, strict=True))
        print(
            f"{name:11} plain {statistics.median(plain):7.1f} tok/s  prompt lookup "
            f"{statistics.median(looked):7.1f} tok/s  ratio {ratio:.3f} (per-trial median)  "
            f"rounds {statistics.median(rounds):.0f}"
        )


if __name__ == "__main__":
    main()
