"""Benchmark: does `mtpkit train-head` with its defaults reach the head it replaces?

Converts the bundled example (`mtpkit/examples/tiny-qwen3_5`), strips its head (the `mtp/`
folder: the state of a published conversion that lost it) and gives it a new one as a user
would, `mtpkit train-head BARE --into BARE` (plus the ARGS of a `--run`), in a fresh process
each. Then it measures greedy depth-1 acceptance, pooled over prompts, with
`measure_acceptance` (the drafting loop `generate --mtp` runs) for the shipped head and each
retrained one, on two sets no run trains on:

- `heldout`: every line of the example's `heldout.txt` (200 docstrings of modules the model
  never saw), its first 60 characters as the prompt, 32 tokens each, no chat template;
- `check`: `check`'s 32 prompts (16 built-in, 16 reserve), 48 tokens each.

and each run's wall time (data generation included) and CPU minutes.

    python bench/train_defaults.py                       # the defaults alone
    python bench/train_defaults.py --run old="--steps 400 --lr 2e-3 --seq-len 128" ...
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"


def heldout_prompts() -> list[str]:
    lines = (EXAMPLE / "heldout.txt").read_text().splitlines()
    return [line[:60] for line in lines if line.strip()]


def retrain(bare: Path, args: list[str]) -> dict:
    """`mtpkit train-head BARE --into BARE ARGS --json` in a fresh process."""
    cmd = [sys.executable, "-m", "mtpkit", "train-head", str(bare), "--into", str(bare)]
    cmd += [*args, "--json"]  # its progress lines go to this script's stderr
    # This checkout first, then whatever the caller's path holds (staged wheels elsewhere).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"train-head {shlex.join(args)} failed (its error is above)")
    record = json.loads(done.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_seconds": round(wall, 1),
        "cpu_minutes": round(cpu / 60, 2),
        "train_seconds": record["seconds"],
        "loss_last": record["loss_last"],
        "run_heldout": record["heldout_acceptance"],
        "settings": {k: record["settings"][k] for k in ("steps", "lr", "batch_size", "seq_len")},
    }


def acceptance(model: Path) -> dict[str, float]:
    from mtpkit.core.prompts import BUILTIN_PROMPTS, RESERVE_PROMPTS
    from mtpkit.speculative.generate import measure_acceptance

    return {
        "heldout": measure_acceptance(model, heldout_prompts(), max_tokens=32, chat_template=False),
        "check": measure_acceptance(model, [*BUILTIN_PROMPTS, *RESERVE_PROMPTS], max_tokens=48),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar='NAME="ARGS"',
        help="A retraining with these train-head arguments (default: one, 'defaults', none).",
    )
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    runs = [r.split("=", 1) for r in args.run] or [["defaults", ""]]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mtpkit-bench-defaults-"))
    try:
        from mtpkit.convert.pipeline import convert

        shipped = work / "shipped"
        convert(str(EXAMPLE), output=shipped, force=True)
        results = {"shipped": {"acceptance": acceptance(shipped)}}
        print("shipped", json.dumps(results["shipped"]), file=sys.stderr, flush=True)
        for name, run_args in runs:
            bare = work / name
            shutil.rmtree(bare, ignore_errors=True)
            shutil.copytree(shipped, bare, ignore=shutil.ignore_patterns("mtp", "mtp.safetensors"))
            results[name] = retrain(bare, shlex.split(run_args))
            results[name]["args"] = run_args
            results[name]["acceptance"] = acceptance(bare)
            print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'head':12} {'heldout':>8} {'check':>8} {'wall s':>7} {'CPU min':>8}  args")
    for name, r in results.items():
        a = r["acceptance"]
        print(
            f"{name:12} {100 * a['heldout']:7.1f}% {100 * a['check']:7.1f}% "
            f"{r.get('wall_seconds', ''):>7} {r.get('cpu_minutes', ''):>8}  {r.get('args', '')}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
