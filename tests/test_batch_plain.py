"""Batched decoding without a drafter (`--no-mtp`, models without a head), proved row by row
against single streams of stock mlx-lm.

The families come from the fixture registry (`tests.checkpoints.RAW_LAYOUTS`, one per
published format): one layout for each kind of cache they build (KV, rotating windows,
gated-delta-net and Mamba arrays, cache lists, MLA's latent KV), so a new family with a new
cache kind is covered without editing this file. Every row's greedy tokens must be the
tokens its prompt gives alone with stock `mlx_lm.stream_generate` on a fresh load: rows of
different prompt lengths (left padding), one joining late, one leaving early at its
max_tokens, one removed mid-way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch import BatchDecoder
from tests.checkpoints import RAW_LAYOUTS, CheckpointFactory, build_dense_model, dtype_for

PROMPTS = [list(range(60, 90)), [300, 301, 302], list(range(5, 21)), [7]]
N = 10


def cache_kinds(m: Any) -> tuple[str, ...]:
    """The kinds of cache `m`'s backbone decodes with (nested cache lists opened), and MLA
    where its config compresses the KV (`kv_lora_rank`)."""
    kinds: set[str] = set()

    def add(cache: Any) -> None:
        kinds.add(type(cache).__name__)
        for part in getattr(cache, "caches", ()):
            add(part)

    for cache in m.make_cache():
        add(cache)
    if m.config.get("kv_lora_rank") or m.config.get("text_config", {}).get("kv_lora_rank"):
        kinds.add("MLA")
    return tuple(sorted(kinds))


def one_layout_per_cache_kind(checkpoint: CheckpointFactory) -> dict[tuple[str, ...], Path]:
    """The first raw layout (in the registry's order) of each distinct set of cache kinds."""
    chosen: dict[tuple[str, ...], Path] = {}
    for layout in RAW_LAYOUTS:
        path = checkpoint(layout, dtype=dtype_for(layout), with_mtp=False)
        kinds = cache_kinds(load_model(path, with_head=False))
        chosen.setdefault(kinds, path)
    return chosen


def stock_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Stock mlx-lm's greedy tokens of each prompt alone (no EOS ends them)."""
    model, tokenizer = mlx_lm.load(str(path))
    tokenizer.eos_token_ids = []
    return [
        [r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(p), max_tokens=n)]
        for p in prompts
    ]


def decode_joining_and_leaving(path: Path) -> list[list[int]]:
    """Rows of `PROMPTS` through one batch without drafts: rows 0 and 1 first (row 1 ends
    early, at 4 tokens), row 2 joins after two steps, row 3 is removed after one more."""
    m = load_model(path, with_head=False)
    decoder = BatchDecoder(m, depth=0, drafts=False)
    decoder.eos = set()
    first = decoder.add(PROMPTS[0], max_tokens=N)
    short = decoder.add(PROMPTS[1], max_tokens=4)
    decoder.step()
    decoder.step()
    late = decoder.add(PROMPTS[2], max_tokens=N)
    removed = decoder.add(PROMPTS[3], max_tokens=N)
    decoder.step()
    decoder.remove(removed)
    while decoder.rows:
        decoder.step()
    assert short.finish == "length" and removed.finish == "cancelled"
    assert decoder.plain_steps > 0 and all(r.drafted == 0 for r in (first, late))
    return [first.tokens, short.tokens, late.tokens, removed.tokens]


def test_every_cache_kind_batches_plainly_as_stock(checkpoint: CheckpointFactory) -> None:
    chosen = one_layout_per_cache_kind(checkpoint)
    kinds = {k for key in chosen for k in key}
    assert {"KVCache", "RotatingKVCache", "ArraysCache", "CacheList", "MLA"} <= kinds
    for key, path in chosen.items():
        references = stock_greedy(path, PROMPTS, N)
        first, short, late, removed = decode_joining_and_leaving(path)
        assert first == references[0] and late == references[2], key
        assert short == references[1][:4], key
        assert 0 < len(removed) < N and removed == references[3][: len(removed)], key


def test_a_model_without_a_head_batches_as_stock(tmp_path: Path) -> None:
    """A dense Llama (no family ships it a head), written by stock mlx-lm itself."""
    path = build_dense_model(tmp_path / "llama")
    references = stock_greedy(path, PROMPTS, N)
    rows = BatchDecoder(load_model(path, with_head=False), depth=0, drafts=False)
    rows.eos = set()
    assert [r.tokens for r in rows.generate(PROMPTS, max_tokens=N)] == references


def test_drafting_needs_a_head(tmp_path: Path) -> None:
    from mtpkit.runtime.model import NoMtpHead

    m = load_model(build_dense_model(tmp_path / "llama"), with_head=False)
    with pytest.raises(NoMtpHead, match="has no MTP head"):
        BatchDecoder(m, depth=1)
