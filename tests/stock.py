"""Stock mlx-lm's own decoding, the independent reference the decoders are held to."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm


def stock_tokens(path: Path, prompt: list[int], max_tokens: int, *, eos: bool = True) -> list[int]:
    """Greedy tokens of stock mlx-lm's `stream_generate` on a fresh, untouched load of
    `path`, the EOS that ends them excluded (`eos` False: no token ends them)."""
    model, tokenizer = mlx_lm.load(str(path))
    if not eos:
        tokenizer.eos_token_ids = []
    out = []
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
        if r.finish_reason == "stop":
            break
        out.append(r.token)
    return out
