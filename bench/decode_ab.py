"""The decoder of another git revision against this one, in one process, interleaved.

    python bench/decode_ab.py MODEL_DIR [--before REV] [--trials N] [--max-tokens N]

Loads `mtpkit/speculative/decode.py` (and `mtpkit/speculative/accept.py` if it has one) as of REV (default: main)
beside the working tree's, on the same loaded model, and times per trial, interleaved:
stock `mlx_lm.stream_generate`, then for each decoder its plain decoding (no MTP), MTP at
depths 1..3 (no adaptive drafting), depth 1 with adaptive drafting, which it also reports
over its own plain decoding, and `generate --mtp`'s default (adaptive drafting choosing the
depth, where the decoder has that; else depth 1 adaptive). Prints, per
configuration, the median decode tok/s over stock's in the same trial, with its range, by
the wall clock and by the process's CPU time (on a machine shared with other jobs the wall
clock mostly measures them; CPU time does not see the overlap `mx.async_eval` buys).
Greedy outputs of both decoders are checked equal to stock's on the way.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLOCKS = {"wall": "the wall clock", "cpu": "this process's CPU time"}
sys.path.insert(0, str(ROOT))


def load_revision(rev: str, tmp: Path) -> types.ModuleType:
    """`mtpkit.speculative.decode` as of `rev`, importable beside the current one (as `decode_<rev>`)."""
    files = {}
    for name in ("accept", "decode"):
        for package in ("speculative", "spec"):  # the package was `spec/` before 2026-11-26
            shown = subprocess.run(
                ["git", "show", f"{rev}:mtpkit/{package}/{name}.py"],
                cwd=ROOT, capture_output=True, text=True,
            )  # fmt: skip
            if shown.returncode == 0:
                files[name] = shown.stdout
                break
    if "accept" in files:  # a revision with its own accept.py: import that one beside it
        path = tmp / "accept_before.py"
        path.write_text(files["accept"])
        spec = importlib.util.spec_from_file_location("mtpkit_accept_before", path)
        accept = importlib.util.module_from_spec(spec)
        sys.modules["mtpkit_accept_before"] = accept
        spec.loader.exec_module(accept)
        for old in ("mtpkit.speculative.accept", "mtpkit.spec.accept"):
            files["decode"] = files["decode"].replace(f"from {old} ", "from mtpkit_accept_before ")
    path = tmp / "decode_before.py"
    path.write_text(files["decode"])
    spec = importlib.util.spec_from_file_location("mtpkit_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["mtpkit_decode_before"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--before", default="main")
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    import mlx_lm

    from mtpkit.bench.speed import DEFAULT_PROMPT
    from mtpkit.core.prompts import encode_prompt
    from mtpkit.runtime.model import load_model
    from mtpkit.speculative import decode
    from mtpkit.speculative.adaptive import AUTO_MAX_DEPTH

    before = load_revision(args.before, Path(tempfile.mkdtemp()))
    m = load_model(args.model)
    m.tokenizer.eos_token_ids = []
    stock_model, stock_tok = mlx_lm.load(args.model)
    stock_tok.eos_token_ids = []
    prompt = encode_prompt(m.tokenizer, DEFAULT_PROMPT)
    n = args.max_tokens

    def timed(tokens) -> tuple[dict[str, float], list[int]]:
        """Tokens per second after the first, by the wall clock and by this process's CPU
        time (all threads; far less disturbed by other jobs on a shared machine)."""
        out = []
        for t in tokens:
            if not out:
                wall, cpu = time.perf_counter(), time.process_time()
            out.append(t)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return {"wall": (len(out) - 1) / wall, "cpu": (len(out) - 1) / cpu}, out

    def stock() -> tuple[dict[str, float], list[int]]:
        stream = mlx_lm.stream_generate(stock_model, stock_tok, prompt, max_tokens=n)
        return timed(r.token for r in stream)

    def mtp(module: types.ModuleType, depth: int, adaptive: bool | str | None):
        """adaptive None: the decoder's plain decoding (no MTP), the baseline of the others;
        "default": `generate --mtp`'s default (adaptive drafting choosing the depth where the
        decoder can, else depth 1)."""
        extra = {}
        if adaptive == "default":
            params = inspect.signature(module.MtpDecoder.__init__).parameters
            if "choose_depth" in params:
                depth, extra = AUTO_MAX_DEPTH, {"choose_depth": True}
        d = module.MtpDecoder(
            m, prompt, depth=depth, sampling=module.SamplingSettings(),
            adaptive=bool(adaptive), use_mtp=adaptive is not None, **extra,
        )  # fmt: skip
        return timed(d.tokens(n))

    configs = [("plain", 1, None)] + [(f"d{k}", k, False) for k in (1, 2, 3)]
    configs.append(("adaptive d1", 1, True))
    configs.append(("default", 1, "default"))
    decoders = {"before": before, "after": decode}
    ratios: dict[tuple[str, str], list[float]] = {}
    reference = stock()[1]
    for dec in decoders.values():  # warm up, and check greedy identity
        for _, k, ad in configs:
            assert mtp(dec, k, ad)[1] == reference, "greedy output differs from stock"
    for trial in range(args.trials):
        base, _ = stock()
        for label, dec in decoders.items():
            for name, k, ad in configs:
                rates, _ = mtp(dec, k, ad)
                for clock in CLOCKS:
                    ratios.setdefault((clock, f"{label} {name}"), []).append(
                        rates[clock] / base[clock]
                    )
        print(f"trial {trial + 1}/{args.trials}: stock {base['wall']:.1f} tok/s", file=sys.stderr)
    for clock in CLOCKS:
        print(
            f"{args.model}: MTP decode tok/s over stock mlx-lm's in the same trial, by "
            f"{CLOCKS[clock]} (median [min-max] of {args.trials} interleaved trials, {n} tokens)"
        )
        for name, _, _ in configs:
            cells = []
            for label in decoders:
                r = ratios[(clock, f"{label} {name}")]
                cells.append(f"{label} {statistics.median(r):.3f} [{min(r):.2f}-{max(r):.2f}]")
            b, a = (statistics.median(ratios[(clock, f"{x} {name}")]) for x in decoders)
            print(f"  {name:12s} " + "  ".join(cells) + f"  after/before {a / b:.3f}")
        for label in decoders:  # MTP over the same decoder's plain decoding, per trial
            plain = ratios[(clock, f"{label} plain")]
            r = [x / p for x, p in zip(ratios[(clock, f"{label} adaptive d1")], plain, strict=True)]
            print(f"  {label} adaptive d1 / {label} plain: {statistics.median(r):.3f} "
                  f"[{min(r):.2f}-{max(r):.2f}]")


if __name__ == "__main__":
    main()
