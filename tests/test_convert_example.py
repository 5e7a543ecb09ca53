"""End to end on a trained checkpoint: a converted head must actually predict.

Random fixtures prove names, shapes and bits; only a head that has learnt something can show
that the conversion kept its meaning. `mtpkit/examples/tiny-qwen3_5` is a raw Qwen3.5
checkpoint (zero-centred norms, HF conv1d layout) with a jointly trained MTP head. After
conversion, acceptance must be high as shipped and clearly lower with the head's norms
shifted once more (a double shift) or not at all (a missing shift).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from mtpkit.convert.grafting import graft
from mtpkit.convert.pipeline import convert
from mtpkit.speculative.generate import measure_acceptance

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"

@pytest.fixture(scope="module")
def prompts() -> list[str]:
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return [line[:60] for line in lines[:6]]


def _acceptance(path: Path, prompts: list[str], shift: float = 0.0) -> float:
    return measure_acceptance(path, prompts, max_tokens=24, chat_template=False, norm_shift=shift)


@pytest.mark.parametrize(
    "flags",
    [{}, {"bits": 4}, {"bits": 4, "keep_mtp_bf16": True}, {"dtype": "float32"}],
    ids=["as-stored", "4bit", "4bit-bf16-head", "float32"],
)
def test_converted_head_predicts(flags, prompts, tmp_path):
    out = convert(str(EXAMPLE), output=tmp_path / "out", **flags).output
    shipped = _acceptance(out, prompts)
    assert shipped >= 0.5
    assert _acceptance(out, prompts, shift=1.0) < shipped - 0.05  # a double shift hurts
    assert _acceptance(out, prompts, shift=-1.0) < 0.1  # a missing shift breaks it


def test_grafted_head_predicts_like_a_full_conversion(prompts, tmp_path):
    from mlx_lm.convert import convert as stock

    trunk = tmp_path / "trunk"
    with contextlib.redirect_stdout(io.StringIO()):
        stock(str(EXAMPLE), str(trunk), quantize=True, q_bits=4, q_group_size=64)
    graft(str(EXAMPLE), into=trunk)
    full = convert(str(EXAMPLE), output=tmp_path / "full", bits=4).output
    assert _acceptance(trunk, prompts) == _acceptance(full, prompts)
