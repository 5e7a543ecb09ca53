"""`mtpkit generate -p A -p B ...`: the prompts decode together in one batch
(`mtpkit.speculative.batch.generate`); each request's text is printed in the prompts'
order, then the batch's figures."""

from __future__ import annotations

import sys
from typing import Any

import typer

from mtpkit.cli.output import FRAME
from mtpkit.cli.ranks import rank_number, refuse_on_ranks

# What one stream has and a batch does not (the option, the parameter's value that means
# "not given"): a batch runs on one machine, from every prompt's first token, with mlx-lm's
# default prefill and full-precision caches.
ONE_STREAM_ONLY = {
    "pipeline": ("--pipeline", False),
    "max_kv_size": ("--max-kv-size", None),
    "prompt_cache_file": ("--prompt-cache-file", None),
    "kv_bits": ("--kv-bits", None),
    "xtc_probability": ("--xtc-probability", 0.0),
    "prefill_step_size": ("--prefill-step-size", 2048),
}


def refuse_one_stream_options(ctx: typer.Context) -> None:
    """A usage error (exit 2) naming the first option given that a batch cannot honour."""
    if rank_number() is not None:
        refuse_on_ranks(
            "several prompts decode together on one machine: under mlx.launch pass one --prompt"
        )
    for name, (flag, unset) in ONE_STREAM_ONLY.items():
        if ctx.params.get(name, unset) != unset:
            ctx.fail(f"{flag} works on one prompt: several prompts decode together without it")


def generate_several(
    model: str,
    prompts: list[str],
    *,
    json_output: bool,
    verbose: bool,
    warn: Any,
    **options: Any,
) -> None:
    """Decode `prompts` together and print each request's text (or the batch's JSON)."""
    from mtpkit.cli.output import print_json
    from mtpkit.speculative.batch.generate import generate_batch

    result = generate_batch(model, prompts, warn=warn, **options)
    if json_output:
        print_json(result.to_json())
        return
    for i, request in enumerate(result.results, 1):
        if verbose:
            print(f"{FRAME} [{i}/{len(result.results)}]")
        sys.stdout.write(request.text + "\n")
    if verbose:
        print_batch(result)
    sys.stdout.flush()


def print_batch(result: Any) -> None:
    """mlx_lm.generate's closing lines for the whole batch (its rates are the batch's
    aggregate ones, as mlx-lm's `batch_generate` reports them), then the MTP line."""
    results = result.results
    width = len(results)
    tps = "n/a" if result.decode_tps is None else f"{result.decode_tps:.3f}"
    prompt_tokens = sum(r.prompt_tokens for r in results)
    generated = sum(r.generation_tokens for r in results)
    print(FRAME)
    print(
        f"Prompt: {prompt_tokens} tokens ({width} requests), {result.prompt_tps:.3f} tokens-per-sec"
    )
    print(f"Generation: {generated} tokens ({width} requests), {tps} tokens-per-sec")
    print(f"Peak memory: {result.peak_memory_gb:.3f} GB")
    if result.mtp:
        drafted = sum(r.drafted for r in results)
        accepted = sum(r.accepted for r in results)
        acc = f"{accepted / drafted:.1%}" if drafted else "n/a"
        by = "" if result.drafter == "mtp" else f"{result.drafter}, "
        line = f"MTP: {by}batch of {width}, acceptance {acc} ({accepted}/{drafted})"
    else:
        line = f"MTP: off (plain batched decoding, batch of {width})"
    print(line, flush=True)
