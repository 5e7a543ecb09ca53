"""mtpkit's environment switches A/B, in one process, interleaved with stock mlx-lm.

    python bench/env_ab.py MODEL_DIR|SHAPE [--set NAME=VALUE ...] [--acceptance A]
        [--depth D] [--adaptive] [--trials N] [--max-tokens N]

Each `--set` is one variant beside the default (several names in one variant: `--set
A=0,B=0`). The switches are read at each call (`core.environment.switch`), so every trial
runs, on the same loaded model: stock mlx-lm's `stream_generate`, then MTP decoding at
`--depth` (or `--adaptive`) under the default and under each variant, in turn. A random SHAPE gets oracle drafts at `--acceptance`
(default 0.8, SYNTHETIC); a model directory drafts with its own head. Printed per variant:
the median decode tok/s over stock's in the same trial with its range, and stock against
itself (each stock run over the one before it: the noise every ratio carries).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
from pathlib import Path

from mtpkit.bench.shapes import SHAPES, random_model_dir
from mtpkit.bench.speed import DEFAULT_PROMPT, mtp_run, stock_run, stock_tokens
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model, untapped
from mtpkit.speculative.oracle import OracleDrafts


def parse_variant(text: str) -> dict[str, str]:
    pairs = [p.split("=", 1) for p in text.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"--set {text}: expected NAME=VALUE[,NAME=VALUE...]")
    return dict(pairs)


class Switched:
    """The environment with `values` set, restored after."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values, self.saved = values, {}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="a model directory, or a --random shape")
    parser.add_argument("--set", dest="variants", action="append", default=[], type=parse_variant)
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--adaptive", action="store_true")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=None, help="a random shape's layers")
    args = parser.parse_args()

    built = None
    if args.target in SHAPES:
        built = random_model_dir(args.target, "bfloat16", layers=args.layers)
        path = built
    else:
        path = Path(args.target)
    m = load_model(path)
    prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT, chat_template=True)
    m.tokenizer.eos_token_ids = []  # every run decodes --max-tokens (a trained model's EOS too)
    reference = None
    if built is not None:
        with untapped(m.final_norm):
            reference = stock_tokens(m.model, m.tokenizer, prompt, args.max_tokens + 8)
    vocab = m.embedding.weight.shape[0]
    variants = [{}, *args.variants]
    names = ["default", *(",".join(f"{k}={v}" for k, v in var.items()) for var in variants[1:])]

    def run() -> float:
        oracle = None
        if reference is not None:
            oracle = OracleDrafts(reference, len(prompt), args.acceptance, vocab)
        tps, _, _ = mtp_run(
            m, prompt, 3 if args.adaptive else args.depth, args.max_tokens,
            adaptive=args.adaptive, draft_filter=oracle,
        )  # fmt: skip
        return tps

    ratios: dict[str, list[float]] = {n: [] for n in names}
    noise: list[float] = []
    last_stock = None
    for trial in range(args.trials + 1):  # trial 0 warms every path up, uncounted
        with untapped(m.final_norm):
            stock = stock_run(m.model, m.tokenizer, prompt, args.max_tokens)
        if trial and last_stock:
            noise.append(stock / last_stock)
        last_stock = stock
        for name, var in zip(names, variants, strict=True):
            with Switched(var):
                tps = run()
            if trial:
                ratios[name].append(tps / stock)
        print(f"... trial {trial}/{args.trials}: stock {stock:.1f} tok/s", flush=True)

    what = "adaptive" if args.adaptive else f"depth {args.depth}"
    oracle = f" at oracle acceptance {args.acceptance} (SYNTHETIC)" if reference else ""
    print(f"\n{path.name}: MTP {what}{oracle}, {args.trials} trials, over stock in each trial")
    print(f"  stock / stock: {statistics.median(noise):.2f} [{min(noise):.2f}-{max(noise):.2f}]")
    for key, values in ratios.items():
        print(f"  {key}: {statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]")
    if built is not None:
        shutil.rmtree(built.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
