"""Time to first token at a long prompt: `mtpkit serve` with the head (one stream, and a batch
join with `--decode-concurrency 4`), `mtpkit serve --no-mtp` and `mlx_lm.server`, on the same
model directory, all started at once and each prompt sent to every server in turn (the order
rotating), one request at a time: an idle server takes no time from the one answering, and a
machine whose load drifts slows every server alike.

Each request is a streamed greedy completion of a prompt of about `--prompt-tokens` tokens
(the servers' usage gives the count): a line of its own, so that no prompt cache holds any of
it, the probe prompts repeated, and a probe prompt that the bundled example continues. TTFT is
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

from mtpkit.bench.serve_load import (
    REQUEST_TIMEOUT,
    Sample,
    long_prompt,
    one_request,
    probe_prompts,
)
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
    """`count` prompts of about `tokens` tokens each (as the model's tokenizer counts them):
    a line of its own, the probe prompts repeated, then one probe prompt whole (one the
    bundled example continues at length)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model))
    ends, out = probe_prompts(), []
    for i in range(count):
        end = tokenizer.encode(ends[i % len(ends)], add_special_tokens=False)
        filler = tokenizer.encode(f"Request {i}.\n\n" + long_prompt(tokens))
        out.append(tokenizer.decode(filler[: tokens - len(end)] + end))
    return out


def measure(
    names: list[str], model: str, texts: list[str], max_tokens: int, work: Path
) -> dict[str, list[Sample]]:
    """Each prompt sent to every server in turn (the order rotating), one request at a time:
    a machine whose load drifts slows every server alike."""
    servers = []
    try:
        for name in names:
            command, extra = SERVERS[name]
            port = free_port()
            servers.append(
                ServerProcess(name, command(model, port, extra), port, work / f"{name}.log")
            )
        for server in servers:
            server.wait_ready()
        samples: dict[str, list[Sample]] = {name: [] for name in names}
        for i, text in enumerate(texts):
            for k in range(len(servers)):
                server = servers[(i + k) % len(servers)]
                sample = asyncio.run(_one(server.url, model, text, max_tokens, i))
                samples[server.name].append(sample)
        return samples
    finally:
        for server in servers:
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
    results = measure(names, model, texts, args.max_tokens, work)
    report(results, names, args.json)


def report(results: dict[str, list[Sample]], names: list[str], as_json: bool) -> None:
    """TTFT and end-to-end latency (request sent -> last byte) per server, medians."""
    ttft = {n: statistics.median(s.ttft for s in results[n]) for n in names}
    latency = {n: statistics.median(s.latency for s in results[n]) for n in names}
    reference = ttft.get("mlx_lm")
    equal = {n: [s.text for s in results[n]] == [s.text for s in results[names[0]]] for n in names}
    if as_json:
        out = {
            n: {
                "ttft_s": [s.ttft for s in results[n]], "ttft_p50_s": ttft[n],
                "latency_p50_s": latency[n],
                "prompt_tokens": [s.prompt_tokens for s in results[n]],
                "texts_equal_to_first": equal[n],
            }
            for n in names
        }  # fmt: skip
        print(json.dumps(out, indent=2))
        return
    print("| server | prompt tokens | TTFT p50 s | each | vs mlx_lm | latency p50 s | texts equal |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        samples = results[n]
        each = " / ".join(f"{s.ttft:.2f}" for s in samples)
        ratio = f"{ttft[n] / reference:.2f}x" if reference else "-"
        tokens = ",".join(sorted({str(s.prompt_tokens) for s in samples}))
        print(
            f"| {n} | {tokens} | {ttft[n]:.2f} | {each} | {ratio} | {latency[n]:.2f} | {equal[n]} |"
        )


if __name__ == "__main__":
    main()
