"""Time to first token at a long prompt: `mtpkit serve` with the head (one stream, and a batch
join with `--decode-concurrency 4`), `mtpkit serve --no-mtp` and `mlx_lm.server`, on the same
model directory, one server at a time (the others stopped: nothing shares the cores), one
request at a time.

Each request is a streamed greedy completion of a prompt of exactly `--prompt-tokens` tokens
(the probe prompts repeated, cut to that count and decoded; the servers' usage confirms the
count), each prompt opening on its own line so that no prompt cache holds any of it. TTFT is
request sent -> first text chunk (`mtpkit.bench.serve_load.one_request`). Every server gets
the same prompts; their greedy texts must be equal (the script says where they are not).

    .venv/bin/python bench/serve_ttft.py --model DIR [--prompt-tokens 3500] [--requests 3]
        [--max-tokens 16] [--servers mtpkit,mtpkit-batch,no-mtp,mlx_lm] [--json]

Converts the bundled example when `--model` is not given (its context is 4,096 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import httpx

from mtpkit.bench.serve_load import REQUEST_TIMEOUT, Sample, long_prompt, one_request
from mtpkit.bench.serve_servers import (
    ServerProcess,
    free_port,
    mlx_lm_command,
    mtpkit_command,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"
SERVERS = {  # name -> (command builder, its extra arguments)
    "mtpkit": (mtpkit_command, []),
    "mtpkit-batch": (mtpkit_command, ["--decode-concurrency", "4"]),
    "no-mtp": (mtpkit_command, ["--no-mtp"]),
    "mlx_lm": (mlx_lm_command, []),
}


def prompts(model: str, tokens: int, count: int) -> list[str]:
    """`count` prompts of `tokens` tokens each (as the model's tokenizer counts them), each
    opening on a line of its own."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    out = []
    for i in range(count):
        ids = tokenizer.encode(f"Request {i}.\n\n" + long_prompt(tokens))[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def measure(name: str, model: str, texts: list[str], max_tokens: int, work: Path) -> list[Sample]:
    command, extra = SERVERS[name]
    port = free_port()
    server = ServerProcess(name, command(model, port, extra), port, work / f"{name}.log")
    try:
        server.wait_ready()
        samples = []
        for i, text in enumerate(texts):
            samples.append(asyncio.run(_one(server.url, model, text, max_tokens, i)))
        return samples
    finally:
        server.stop()


async def _one(url: str, model: str, text: str, max_tokens: int, index: int) -> Sample:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        return await one_request(client, url, model, text, max_tokens, index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--prompt-tokens", type=int, default=3500)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = args.servers.split(",")
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        parser.error(f"unknown server {unknown[0]!r} (choose from {', '.join(SERVERS)})")
    work = Path(tempfile.mkdtemp(prefix="serve-ttft-"))
    model = args.model
    if model is None:
        from mtpkit.convert.pipeline import convert

        model = str(work / "tiny-mlx")
        convert(str(EXAMPLE), output=model)
    texts = prompts(model, args.prompt_tokens, args.requests)
    results = {n: measure(n, model, texts, args.max_tokens, work) for n in names}
    report(results, names, args.json)


def report(results: dict[str, list[Sample]], names: list[str], as_json: bool) -> None:
    ttft = {n: statistics.median(s.ttft for s in results[n]) for n in names}
    reference = ttft.get("mlx_lm")
    texts = {n: [s.text for s in results[n]] for n in names}
    equal = {n: texts[n] == texts[names[0]] for n in names}
    if as_json:
        out = {
            n: {
                "ttft_s": [s.ttft for s in results[n]], "ttft_p50_s": ttft[n],
                "prompt_tokens": [s.prompt_tokens for s in results[n]],
                "texts_equal_to_first": equal[n],
            }
            for n in names
        }  # fmt: skip
        print(json.dumps(out, indent=2))
        return
    print("| server | prompt tokens | TTFT p50 s | each | vs mlx_lm | texts equal |")
    print("|---|---|---|---|---|---|")
    for n in names:
        samples = results[n]
        each = " / ".join(f"{s.ttft:.2f}" for s in samples)
        ratio = f"{ttft[n] / reference:.2f}x" if reference else "-"
        tokens = ",".join(sorted({str(s.prompt_tokens) for s in samples}))
        print(f"| {n} | {tokens} | {ttft[n]:.2f} | {each} | {ratio} | {equal[n]} |")


if __name__ == "__main__":
    main()
