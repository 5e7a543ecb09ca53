"""Plain decoding, as `generate --no-mtp` runs it: stock mlx-lm's `stream_generate`, unchanged,
and the mlx_lm.generate options only that loop honours (`MlxLmOptions`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.runtime.model import MtpModel, untapped
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.stats import Stats


@dataclass(frozen=True)
class MlxLmOptions:
    """mlx_lm.generate's options beyond sampling and the prompt. Every decode honours the
    prefill step; the others only plain decoding (`--no-mtp`, stock mlx-lm's own loop):
    XTC draws its own random cut per token, which no draft's probability can be judged
    against; a quantized KV cache and a saved prompt cache hold the target's state without
    the drafter's."""

    prefill_step_size: int = 2048
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 5000
    prompt_cache_file: str | None = None
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.0

    def plain_only(self) -> list[str]:
        """The options set that only plain decoding honours, as flags."""
        return [
            flag
            for flag, on in (
                ("--kv-bits", self.kv_bits is not None),
                ("--prompt-cache-file", self.prompt_cache_file is not None),
                ("--xtc-probability", self.xtc_probability > 0),
            )
            if on
        ]

    def plain_only_reason(self) -> str:
        flags = self.plain_only()
        why = {
            "--kv-bits": "a quantized KV cache is not rolled back",
            "--prompt-cache-file": "a saved prompt cache holds no drafter state",
            "--xtc-probability": "XTC's random cut per token cannot judge a draft",
        }
        return f"{', '.join(flags)} only applies to plain decoding ({'; '.join(why[f] for f in flags)})"


MLX_LM_DEFAULTS = MlxLmOptions()


def stock_tokens(
    m: MtpModel,
    prompt: list[int],
    *,
    max_tokens: int,
    sampling: SamplingSettings,
    max_kv_size: int | None = None,
    options: MlxLmOptions = MLX_LM_DEFAULTS,
) -> tuple[Iterator[int], Callable[[], Stats]]:
    """Plain decoding is stock mlx-lm's `stream_generate`, unchanged."""
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import load_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    stats = Stats(prompt_tokens=len(prompt))

    def run() -> Iterator[int]:
        start = time.perf_counter()
        first = None
        sampler = sampling.sampler()
        if options.xtc_probability > 0:  # as mlx_lm.generate builds it
            sampler = make_sampler(
                sampling.temp, sampling.top_p, sampling.min_p, sampling.min_tokens_to_keep,
                top_k=sampling.top_k, xtc_probability=options.xtc_probability,
                xtc_threshold=options.xtc_threshold,
                xtc_special_tokens=m.tokenizer.encode("\n") + list(m.tokenizer.eos_token_ids),
            )  # fmt: skip
        extra: dict[str, Any] = {}
        if options.prompt_cache_file is not None:
            extra["prompt_cache"] = load_prompt_cache(options.prompt_cache_file)
        with untapped(m.final_norm):
            for response in stream_generate(
                m.model,
                m.tokenizer,
                mx.array(prompt),
                max_tokens=max_tokens,
                sampler=sampler,
                prompt_progress_callback=lambda *_: m.lockstep.tick(),
                max_kv_size=max_kv_size,
                prefill_step_size=options.prefill_step_size,
                kv_bits=options.kv_bits,
                kv_group_size=options.kv_group_size,
                quantized_kv_start=options.quantized_kv_start,
                **extra,
            ):
                if first is None:
                    first = time.perf_counter()
                    stats.prompt_time = first - start
                m.lockstep.tick()
                if response.finish_reason == "stop":
                    break
                stats.generated.append(response.token)
                yield response.token
        # As for MTP decoding: the first token's time is the prompt's.
        stats.decode_time = time.perf_counter() - (first or start)
        stats.decode_tokens = max(0, len(stats.generated) - 1)

    return run(), lambda: stats
