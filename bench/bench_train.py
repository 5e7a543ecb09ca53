"""Benchmark: `mtpkit train-head` on the bundled tiny example, and at a real model's shape.

Default (CPU): converts `mtpkit/examples/tiny-qwen3_5`, removes its head, retrains one with
`mtpkit train-head` (self-generated data, 500 steps; `tests/test_train.py` runs 150) in a fresh
process, and prints

- greedy depth-1 acceptance of the shipped and the retrained head on held-out docstrings
  (`heldout.txt`, modules the model never saw; 32 tokens) and on `check`'s 32 prompts (48
  tokens), measured by `measure_acceptance` (neither set is among the training prompts);
- the run's CPU minutes (target <= 10), wall time and steps/s;
- peak RSS of two more runs on a file corpus of about 1 MB and one 10x larger (flat memory:
  the corpus is streamed, hidden states exist only for the batch at hand).

`--random-shape qwen3_5-0.8b` (for the GPU machine) builds a random 4-bit model of that shape
(`mtpkit bench --random`'s), trains its head on a streamed file corpus, and prints steps/s,
tokens/s and peak memory.

    python bench/bench_train.py [--steps N] [--workdir DIR] [--keep]
    python bench/bench_train.py --random-shape qwen3_5-0.8b [--steps 30] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"
# The example's retraining (tests/test_train.py runs the same for 150 steps).
EXAMPLE_ARGS = ["--steps", "500", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3"]
CORPUS_BYTES = 1 << 20


def train(model: Path, out: Path, args: list[str]) -> dict:
    """`mtpkit train-head MODEL -o OUT ARGS --json` in a fresh process (its own peak RSS)."""
    cmd = [sys.executable, "-m", "mtpkit", "train-head", str(model), "-o", str(out)]
    cmd += [*args, "--json", "--force"]
    # This checkout first, then whatever the caller's path holds (the GPU machine's staged
    # MLX wheels live on PYTHONPATH, which the child needs too).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"train-head failed:\n{done.stderr}")
    return json.loads(done.stdout)


def heldout_prompts(n: int) -> list[str]:
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return [line[:60] for line in lines[-n:]]


def docstring_corpus(path: Path, size: int) -> Path:
    """About `size` bytes of English docstrings from the standard library, one paragraph each,
    cycled until the size is reached (a text corpus that needs no download). The held-out
    docstrings of the example (`heldout.txt`) are left out."""
    heldout = {line.strip() for line in (EXAMPLE / "heldout.txt").read_text().splitlines()}
    docs: list[str] = []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                text = " ".join((doc or "").split())
                if len(text) > 40 and text not in heldout:
                    docs.append(text)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            for doc in docs:
                f.write(doc + "\n\n")
                written += len(doc) + 2
                if written >= size:
                    break
    return path


def example(args: argparse.Namespace, work: Path) -> dict:
    from mtpkit.convert.pipeline import convert
    from mtpkit.speculative.generate import measure_acceptance

    shipped = work / "tiny-mlx"
    convert(str(EXAMPLE), output=shipped, force=True)
    headless = work / "headless"
    shutil.rmtree(headless, ignore_errors=True)
    shutil.copytree(shipped, headless, ignore=shutil.ignore_patterns("mtp"))
    steps = ["--steps", str(args.steps)] if args.steps else []
    run = train(headless, work / "retrained", [*EXAMPLE_ARGS, *steps])
    from mtpkit.core.prompts import BUILTIN_PROMPTS, RESERVE_PROMPTS

    prompts = heldout_prompts(args.prompts)
    probes = [*BUILTIN_PROMPTS, *RESERVE_PROMPTS]

    def acc(path: Path) -> dict[str, float]:
        return {
            "docstrings": measure_acceptance(path, prompts, max_tokens=32, chat_template=False),
            "check_prompts": measure_acceptance(path, probes, max_tokens=48),
        }

    small = docstring_corpus(work / "small.txt", CORPUS_BYTES)
    large = docstring_corpus(work / "large.txt", 10 * CORPUS_BYTES)
    corpus_args = ["--steps", "40", "--batch-size", "8", "--seq-len", "64", "--eval-every", "40"]
    rss = {}
    for name, corpus in (("small", small), ("large", large)):
        r = train(headless, work / f"corpus-{name}", [*corpus_args, "--data", str(corpus)])
        rss[name] = {"corpus_bytes": corpus.stat().st_size, "peak_rss_bytes": r["peak_rss_bytes"]}
    return {
        "shipped_acceptance": acc(shipped),
        "retrained_acceptance": acc(Path(run["output"])),
        "heldout_prompts": len(prompts),
        "heldout_start": run["heldout_acceptance_start"],
        "heldout_final": run["heldout_acceptance"],
        "cpu_minutes": run["cpu_seconds"] / 60,
        "train_seconds": run["seconds"],
        "steps": run["steps"],
        "steps_per_s": run["steps_per_s"],
        "peak_rss_bytes": run["peak_rss_bytes"],
        "corpus_rss": rss,
        "rss_growth_10x": rss["large"]["peak_rss_bytes"] / rss["small"]["peak_rss_bytes"] - 1,
    }


def random_shape(args: argparse.Namespace, work: Path) -> dict:
    from mtpkit.bench.shapes import random_model_dir
    from mtpkit.runtime.model import library_io

    with library_io():  # mlx-lm's quantization note to stderr
        model = random_model_dir(args.random_shape, args.dtype)
    try:
        shutil.rmtree(model / "mtp", ignore_errors=True)
        corpus = docstring_corpus(work / "corpus.txt", CORPUS_BYTES)
        steps = args.steps or 30
        sizes = ["--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
        run_args = ["--steps", str(steps), *sizes, "--eval-every", str(steps)]
        run = train(model, work / "trained", [*run_args, "--data", str(corpus)])
    finally:
        shutil.rmtree(model.parent, ignore_errors=True)
    return {
        "shape": args.random_shape,
        "steps": run["steps"],
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "train_seconds": run["seconds"],
        "steps_per_s": run["steps_per_s"],
        "tokens_per_s": run["tokens"] / run["seconds"],
        "peak_rss_bytes": run["peak_rss_bytes"],
        "peak_mlx_bytes": run["peak_mlx_bytes"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--random-shape", choices=["qwen3_5-0.8b"], default=None)
    p.add_argument("--steps", type=int, default=None, help="Override the step count.")
    p.add_argument("--batch-size", type=int, default=8, help="--random-shape only.")
    p.add_argument("--seq-len", type=int, default=512, help="--random-shape only.")
    p.add_argument(
        "--dtype", default="float32", help="--random-shape: scales' dtype (GPU: bfloat16)."
    )
    p.add_argument("--prompts", type=int, default=16, help="Held-out prompts measured.")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="Keep the work directory.")
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mtpkit-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = random_shape(args, work) if args.random_shape else example(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for key, value in result.items():
        print(f"{key:24} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
