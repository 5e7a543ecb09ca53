"""mlx-vlm's own MTP drafter decodes an mtpkit conversion (issue 20).

mlx-vlm 0.7.10 (in the test extra: it installs with `mlx[cpu]` on Linux) loads the head through
its own `load_drafter(..., kind="mtp")` from the conversion's `mtp.safetensors` and decodes
with its own speculative loop (`mlx_vlm.generate.ar.generate_step`, one draft per round, as
`--draft-kind mtp --draft-block-size 2` runs). Its greedy tokens must equal stock mlx-lm's on
the same directory, and its acceptance must show that the head it built predicts: the
declarations it reads (`format: mlx`, `mtplx_mtp_quantization`) are each shown load-bearing.

bf16 runs compare exactly. The 4-bit run is float32 (`--dtype float32`): in bf16, mlx-vlm's
2-token verify and mlx-lm's 1-token step round differently and flip near-ties (top-2 logits
one bf16 step apart), which says nothing about the head.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.convert.pipeline import convert

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return [line[:60] for line in lines[:3]]


def _stock(model_dir: Path, prompts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids and stock mlx-lm's greedy tokens (its load and generate_step, EOS ignored)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    ids = [tokenizer.encode(p) for p in prompts]
    out = [
        [int(t) for t, _ in generate_step(mx.array(i), model, max_tokens=MAX_TOKENS)] for i in ids
    ]
    return ids, out


def _mlx_vlm(model_dir: Path, ids: list[list[int]]) -> tuple[list[list[int]], float]:
    """mlx-vlm's greedy tokens with its MTP drafter, and its acceptance over all prompts."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load

    model, _ = load(str(model_dir))
    drafter, kind = load_drafter(str(model_dir), kind="mtp")
    assert kind == "mtp"
    outputs, accepted, drafted = [], 0, 0
    for prompt in ids:
        tokens: list[int] = []
        for t, _ in generate_step(
            mx.array([prompt]), model, None, None, max_tokens=MAX_TOKENS, temperature=0.0,
            draft_model=drafter, draft_kind=kind, draft_block_size=2,
        ):  # fmt: skip
            tokens.extend(t if isinstance(t, list) else [int(t)])
        outputs.append(tokens[:MAX_TOKENS])
        accepted += sum(drafter.accept_lens)
        drafted += sum(drafter.draft_lens)
    return outputs, accepted / drafted


@pytest.mark.parametrize(
    ("flags", "floor"),
    [({}, 0.6), ({"bits": 4, "mtp_bits": 8, "dtype": "float32"}, 0.4)],
    ids=["as-stored", "4bit-8bit-head"],
)
def test_mlx_vlm_decodes_the_conversion_like_stock_mlx_lm(flags, floor, prompts, tmp_path):
    out = convert(str(EXAMPLE), output=tmp_path / "out", **flags).output
    ids, stock = _stock(out, prompts)
    tokens, acceptance = _mlx_vlm(out, ids)
    assert tokens == stock
    assert acceptance >= floor


def test_without_format_mlx_mlx_vlm_shifts_the_norms_again(converted, prompts, tmp_path):
    """The metadata is what keeps mlx-vlm from adding +1 to norms mtpkit already shifted."""
    import shutil

    damaged = tmp_path / "no-metadata"
    shutil.copytree(converted, damaged)
    weights = mx.load(str(damaged / "mtp.safetensors"))
    mx.save_safetensors(str(damaged / "mtp.safetensors"), weights)  # no `format: mlx`
    ids, stock = _stock(converted, prompts)
    _, shipped = _mlx_vlm(converted, ids)
    tokens, twice = _mlx_vlm(damaged, ids)
    assert tokens == stock  # greedy verification stays lossless
    assert twice < shipped - 0.1  # measured 57.6% vs 75.5%


def test_without_the_head_bits_mlx_vlm_cannot_build_the_head(tmp_path):
    out = convert(str(EXAMPLE), output=tmp_path / "out", bits=4, mtp_bits=8).output
    config = json.loads((out / "config.json").read_text())
    config.pop("mtplx_mtp_quantization")
    (out / "config.json").write_text(json.dumps(config))
    from mlx_vlm.speculative.drafters import load_drafter

    with pytest.raises(ValueError, match="shape"):
        load_drafter(str(out), kind="mtp")
