"""`mtpkit bench --serve`'s client checked against guidellm's on the same server (issue 44).

    /tmp/loadtool/bin/pip install guidellm          # a venv of its own: it pins much
    PYTHONPATH=. .venv/bin/python bench/serve_guidellm.py --url http://127.0.0.1:PORT \
        --model /tmp/tiny-mlx --guidellm /tmp/loadtool/bin/guidellm --clients 4 --requests 16

The same prompts (`serve_load.mixed_prompts`) and output budget go to the running server
twice: through guidellm (`run --profile concurrent`, a JSONL file of prompts, its tokenizer
the model's own, offline) and through `serve_load.run_round` (rounds of `--clients`
requests). Printed side by side: requests, output tokens, TTFT and inter-token latency
(guidellm's ITL is (last - first) / (tokens - 1), our TPOT) medians, output tok/s. guidellm
keeps `--clients` requests in flight; ours sends rounds of them, so the rates differ by
the rounds' tails, the per-request figures should not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from mtpkit.bench.serve_load import mixed_prompts, run_round


def run_guidellm(args: argparse.Namespace, prompts: list[str], work: Path) -> dict:
    data = work / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "output_tokens_count": args.max_tokens}) + "\n"
                for p in prompts)
    )  # fmt: skip
    out = work / "guidellm.json"
    command = [
        args.guidellm, "run",
        "--backend", f"kind=openai_http,target={args.url},model={args.model},"
        "request_format=/v1/completions",
        "--profile", f"kind=concurrent,streams={args.clients}",
        "--constraint", f"kind=max_requests,count={len(prompts)}",
        "--data", f"kind=json_file,path={data}",
        "--tokenizer", f"kind=hf_auto,model={args.model}",
        "--output", f"kind=json,path={out}", "--disable-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def median(key: str) -> float:
        return m[key]["successful"]["median"]

    return {
        "requests": m["request_totals"]["successful"],
        "output_tokens": m["output_token_count"]["successful"]["total_sum"],
        "ttft_ms": median("time_to_first_token_ms"),
        "itl_ms": median("inter_token_latency_ms"),
        "output_tps": m["output_tokens_per_second"]["successful"]["mean"],
    }


def run_ours(args: argparse.Namespace, prompts: list[str]) -> dict:
    samples, wall = [], 0.0
    for i in range(0, len(prompts), args.clients):
        got, seconds, errors = run_round(
            args.url, args.model, prompts[i : i + args.clients], args.max_tokens
        )
        if errors:
            raise SystemExit(errors[0])
        samples += got
        wall += seconds
    return {
        "requests": len(samples),
        "output_tokens": sum(s.tokens for s in samples),
        "ttft_ms": statistics.median(s.ttft for s in samples) * 1e3,
        "itl_ms": statistics.median(s.tpot for s in samples if s.tpot) * 1e3,
        "output_tps": sum(s.tokens for s in samples) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True, help="the served directory (its tokenizer)")
    parser.add_argument("--guidellm", default="guidellm")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = mixed_prompts(args.requests)
    run_round(args.url, args.model, prompts[:2], 16)  # warm-up
    ours = run_ours(args, prompts)
    theirs = run_guidellm(args, prompts, Path(tempfile.mkdtemp(prefix="guidellm-")))
    print(f"{'':14} {'requests':>8} {'out tokens':>10} {'TTFT p50 ms':>12} "
          f"{'ITL p50 ms':>11} {'out tok/s':>10}")  # fmt: skip
    for name, r in (("mtpkit bench", ours), ("guidellm", theirs)):
        print(f"{name:14} {r['requests']:8} {r['output_tokens']:10.0f} {r['ttft_ms']:12.1f} "
              f"{r['itl_ms']:11.2f} {r['output_tps']:10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
