"""Benchmark: what rolling a verify pass back costs, per rollback kind, as ratios to a plain
1-token backbone step measured in the same run.

- Qwen3.5 (the bundled tiny example): gated-delta-net snapshots, restored without a forward
  pass. The replay machinery adds one check per verify pass (`gdn_covers`); its time is
  reported as a fraction of the verify pass, which is what "no slower" rests on.
- Ling-3 (`bailing_moe_v3`), Ling-2.6 (`bailing_hybrid`) and Nemotron-H (`nemotron_h`, Mamba-2)
  fixtures: rollback by replay.
  Keeping all T verify inputs costs nothing; keeping k < T re-runs the backbone over k tokens.

Every figure is the best of --reps runs.

    python bench/bench_rollback.py [--reps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = [5, 17, 100, 3, 250, 42, 7, 9, 300, 11, 64, 128, 77, 21, 33, 40]
VERIFY = [12, 90, 150, 8]  # T = 4: the last confirmed token and three drafts


def _best_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # the least disturbed run: this machine is shared


def measure(model_dir: Path, reps: int) -> dict[str, float]:
    import mlx.core as mx

    from mtpkit.runtime.model import load_model
    from mtpkit.runtime.rollback.gdn import is_recurrent_cache
    from mtpkit.runtime.rollback.replay import gdn_covers

    m = load_model(model_dir)
    tokens = mx.array(VERIFY)

    def fresh():
        cache = m.make_cache()
        logits, _ = m.forward(mx.array([PROMPT]), cache)
        mx.eval(logits, [c.state for c in cache])
        return cache

    def step() -> None:
        cache = fresh_cache[0]
        logits, hidden = m.forward(tokens[None, :1], cache)
        mx.eval(logits, hidden)
        for c in cache:  # back to the prompt's state for the next repetition
            if c.is_trimmable():
                c.trim(1)

    def verify_and_rollback(kept: int) -> float:
        cache = fresh()
        t0 = time.perf_counter()
        verified = m.verify(tokens, cache)
        mx.eval(verified.logits, verified.hidden, [c.state for c in cache])
        verified.rollback(cache, kept)
        mx.eval([c.state for c in cache])
        return time.perf_counter() - t0

    fresh_cache = [fresh()]
    saved = [dict(vars(c)) for c in fresh_cache[0]]

    def restore_plain() -> None:
        for c, s in zip(fresh_cache[0], saved, strict=True):
            vars(c).update({k: list(v) if isinstance(v, list) else v for k, v in s.items()})

    step_s = _best_seconds(lambda: (step(), restore_plain()), reps)
    out = {"step_ms": step_s * 1e3}
    for kept in (len(VERIFY), 1):
        rounds = [verify_and_rollback(kept) for _ in range(reps)]
        out[f"verify_rollback_keep{kept}_over_step"] = min(rounds) / step_s
    cache = fresh_cache[0]
    covers_s = _best_seconds(lambda: gdn_covers(m.model, cache, is_recurrent_cache), reps * 20)
    out["gdn_covers_over_step"] = covers_s / step_s
    out["replay"] = not gdn_covers(m.model, cache, is_recurrent_cache)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from mtpkit.convert.pipeline import convert
    from tests.checkpoints import build_checkpoint

    results = {}
    with tempfile.TemporaryDirectory(prefix="mtpkit-bench-rollback-") as tmp:
        sources = {"qwen3_5 (snapshots)": ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"}
        for layout in ("bailing_moe_v3", "bailing_hybrid", "nemotron_h"):
            raw = build_checkpoint(layout, Path(tmp) / f"{layout}-raw", dtype="float32")
            sources[f"{layout} (replay)"] = raw
        for name, src in sources.items():
            out = convert(str(src), output=Path(tmp) / name.split()[0]).output
            results[name] = measure(out, args.reps)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"T = {len(VERIFY)} verify inputs; ratios to a plain 1-token step of the same model")
    for name, r in results.items():
        print(
            f"{name:28s} step {r['step_ms']:6.2f} ms | verify+rollback keep {len(VERIFY)}: "
            f"{r[f'verify_rollback_keep{len(VERIFY)}_over_step']:.2f}x, keep 1: "
            f"{r['verify_rollback_keep1_over_step']:.2f}x | gdn_covers: "
            f"{r['gdn_covers_over_step']:.4f}x"
        )


if __name__ == "__main__":
    main()
