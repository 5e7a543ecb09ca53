"""The load side of `mtpkit bench --serve`: the prompts, one streamed request timed as the
field times it, and one round of concurrent clients.

A request is a streamed text completion at temperature 0 with
`stream_options.include_usage`, so its token count is the server's own `usage`, not a count
of SSE chunks (an MTP round sends several tokens in one chunk). Its times, as vLLM's and
guidellm's benchmarks define them: time to first token (request sent -> first text chunk),
inter-token latency per token (time from the first chunk to the last over the tokens after
the first, vLLM's TPOT) and per chunk (the gaps between text chunks), end-to-end latency.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from mtpkit.core.errors import MtpkitError

# mtpkit's probe prompts that the bundled example continues past 128 tokens (code, SQL, a
# list; its prose prompts end at an EOS within a few tokens).
LONG_STARTS = ("import os", "class Stack", "for (int", "SELECT", "Numbers from")
# Prompt lengths in turn, in probe prompts put before the last: mixed lengths.
PREFIX_COUNTS = (0, 2, 6, 1, 12)
CHARS_PER_TOKEN = 3  # a rough guess to size the long prompt; usage reports the real count
REQUEST_TIMEOUT = 3600.0
# Seconds between the clients' first requests of a round: mlx_lm.server's listening socket
# keeps socketserver's backlog of 5, and 17 connections opened at once lose some to resets
# on Linux (seen at 16 clients + 1); 10 ms apart, 16 clients arrive within 0.16 s.
STAGGER = 0.01


@dataclass
class Sample:
    """One request's figures (seconds; tokens from the server's usage)."""

    client: int
    prompt_tokens: int
    tokens: int
    ttft: float
    latency: float  # request sent -> last byte
    chunk_gaps: list[float] = field(default_factory=list)
    text: str = ""
    long_prompt: bool = False
    round: int = 0  # the level's round it was sent in
    spec: dict | None = None  # the response's metrics.speculative_decoding, where sent
    # SYNTHETIC: the oracle's share its drafts were right at (mtp.synthetic_acceptance).
    synthetic: float | None = None

    @property
    def tpot(self) -> float | None:
        """Inter-token latency per token: the decode time over the tokens after the first."""
        decode = sum(self.chunk_gaps)  # first text chunk -> last
        return decode / (self.tokens - 1) if self.tokens > 1 and decode > 0 else None

    @property
    def decode_tps(self) -> float | None:
        tpot = self.tpot
        return 1.0 / tpot if tpot else None


def probe_prompts() -> list[str]:
    from mtpkit.core.prompts import BUILTIN_PROMPTS

    return [p for p in BUILTIN_PROMPTS if p.startswith(LONG_STARTS)]


def mixed_prompts(n: int, offset: int = 0) -> list[str]:
    """`n` prompts of mixed lengths: probe prompt i, after a prefix of other probe prompts
    (their count cycling through `PREFIX_COUNTS`), so every prompt ends where the example
    continues at length."""
    from mtpkit.core.prompts import BUILTIN_PROMPTS

    ends, out = probe_prompts(), []
    for i in range(offset, offset + n):
        count = PREFIX_COUNTS[i % len(PREFIX_COUNTS)]
        prefix = [BUILTIN_PROMPTS[(i + j) % len(BUILTIN_PROMPTS)] for j in range(count)]
        out.append("\n\n".join([*prefix, ends[i % len(ends)]]))
    return out


def level_prompts(clients: int, round_index: int) -> list[str]:
    """The prompts of a level's round: each round's clients their own."""
    return mixed_prompts(clients, offset=round_index * clients)


def long_prompt(tokens: int) -> str:
    """A prompt of about `tokens` tokens: the probe prompts repeated, ending on one."""
    from mtpkit.core.prompts import BUILTIN_PROMPTS

    text, i = "", 0
    while len(text) < tokens * CHARS_PER_TOKEN:
        text += BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] + "\n\n"
        i += 1
    return text + probe_prompts()[0]


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, index: int,
    first_token: asyncio.Event | None = None,
) -> Sample:  # fmt: skip
    """One streamed request; `first_token` is set when its first text arrives."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    text, usage, spec, synthetic = "", None, None, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise ServeBenchError(f"{url} answered {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ServeBenchError(f"{url} failed a request: {chunk['error']}")
            usage = chunk.get("usage") or usage
            spec = (chunk.get("metrics") or {}).get("speculative_decoding", spec)
            synthetic = (chunk.get("mtp") or {}).get("synthetic_acceptance", synthetic)
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    if first is None and first_token is not None:
                        first_token.set()
                    first = first or now
                    last = now
                    text += choice["text"]
    end = time.perf_counter()
    if usage is None:
        raise ServeBenchError(f"{url} sent no usage chunk (stream_options.include_usage)")
    return Sample(
        client=index, prompt_tokens=usage["prompt_tokens"], tokens=usage["completion_tokens"],
        ttft=(first or end) - start, latency=end - start, chunk_gaps=gaps, text=text, spec=spec,
        synthetic=synthetic,
    )  # fmt: skip


class ServeBenchError(MtpkitError):
    """A server refused or failed a benchmark request."""


async def _round(
    url: str, model: str, prompts: list[str], max_tokens: int, late: str | None
) -> list[Sample]:
    """`prompts` sent at once; `late` (the long prompt) sent once another client has its
    first token, so it joins while the others decode."""
    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=0)
    started = asyncio.Event()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:

        async def early(i: int, prompt: str) -> Sample:
            await asyncio.sleep(i * STAGGER)
            try:
                return await one_request(client, url, model, prompt, max_tokens, i, started)
            finally:
                started.set()  # a request that failed or sent nothing still lets it go

        async def joiner() -> Sample:
            await started.wait()
            n = len(prompts)
            sample = await one_request(client, url, model, late or "", max_tokens, n, None)
            sample.long_prompt = True
            return sample

        tasks = [early(i, p) for i, p in enumerate(prompts)]
        if late is not None:
            tasks.append(joiner())
        return list(await asyncio.gather(*tasks, return_exceptions=True))


def run_round(
    url: str, model: str, prompts: list[str], max_tokens: int, late: str | None = None
) -> tuple[list[Sample], float, list[str]]:
    """One round's samples, its wall time (first request sent -> last answer) and its
    failed requests' errors (a refusal, an error event, a dropped connection), one line
    each; anything else is raised."""
    start = time.perf_counter()
    results = asyncio.run(_round(url, model, prompts, max_tokens, late))
    wall = time.perf_counter() - start
    samples, errors = [], []
    for r in results:
        if isinstance(r, Sample):
            samples.append(r)
        elif isinstance(r, ServeBenchError | httpx.TransportError):
            errors.append(f"{url}: {type(r).__name__}: {r}".strip())
        else:
            raise r
    return samples, wall, errors
