"""What prompt lookup costs where it finds nothing, and gains where text repeats (CPU or GPU).

    .venv/bin/python bench/prompt_lookup_cost.py [EXAMPLE_MLX_DIR] [TRIALS]

Interleaved trials, plain decoding (`generate --no-mtp`'s decoder path) against
`--prompt-lookup` (adaptive drafting, generate's default), on two models: a random-weight
tiny qwen3_5 (written by the tests' fixture builder) given random token ids, whose output
does not repeat, so lookup finds (almost) nothing and the ratio is what the search costs;
and the bundled example converted (default `tiny-mlx`, the README's first command) given a
repetitive prompt, which it continues repetitively. Prints medians of decode tok/s, the
median per-trial ratio, and the rounds lookup drafted.
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


def random_model(tmp: Path) -> Path:
    from mtpkit.convert.pipeline import convert
    from tests.checkpoints import build_checkpoint

    src = build_checkpoint("qwen3_5", tmp / "src", dtype="float32", seed=7)
    convert(str(src), output=tmp / "mlx")
    return tmp / "mlx"


def main() -> None:
    import tempfile

    example = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "tiny-mlx")
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    tmp = Path(tempfile.mkdtemp())
    cases = []
    for name, path in (("random model, random ids", random_model(tmp)),
                       ("example, repetitive", Path(example))):  # fmt: skip
        m = load_model(path, with_head=False)
        m.tokenizer.eos_token_ids = []  # every run decodes TOKENS tokens
        if name.startswith("random"):
            rng = random.Random(0)
            prompt = [rng.randrange(3, m.embedding.weight.shape[0]) for _ in range(256)]
        else:
            prompt = m.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,")
        cases.append((name, m, prompt, ProposerFactory(m, DrafterChoice(prompt_lookup=True))))
    print(f"{TOKENS} tokens per run, {trials} interleaved trials, medians")
    for name, m, prompt, factory in cases:
        rate(m, prompt, None), rate(m, prompt, factory())  # warm up
        plain, looked, rounds = [], [], []
        for _ in range(trials):
            plain.append(rate(m, prompt, None)[0])
            r, n = rate(m, prompt, factory())
            looked.append(r)
            rounds.append(n)
        ratio = statistics.median(b / a for a, b in zip(plain, looked, strict=True))
        print(
            f"{name:26} plain {statistics.median(plain):7.1f} tok/s  prompt lookup "
            f"{statistics.median(looked):7.1f} tok/s  ratio {ratio:.3f} (per-trial median)  "
            f"rounds {statistics.median(rounds):.0f}"
        )


if __name__ == "__main__":
    main()
