"""`mtpkit train-head` on every family of the registry: a few steps on a tiny checkpoint of
the family, written where `generate` and `check` find it; `mtpkit check`'s checks of the
files pass it, and greedy MTP decoding with it gives stock mlx-lm's greedy tokens.

The families come from `mtpkit.families.FAMILIES`, never a hand list: a family with a fixture
in `tests/fixtures/` trains on it (built without its head, as a conversion that lost it);
one that ships no head (dense decoders) on a model stock mlx-lm writes. MoE fixtures are
float32 (MLX's CPU backend has no half-precision GatherMM). Acceptance itself is not judged
here (random weights, two steps; check's probes judge it): `tests/test_train.py` does that
on the trained example.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mtpkit.check.verdict import check_checkpoint
from mtpkit.families import FAMILIES, family_for
from mtpkit.speculative.generate import generate, load_model
from mtpkit.train.data import DataSpec
from mtpkit.train.loop import TrainSettings, train_head
from mtpkit.train.output import write_trained_head
from tests.checkpoints import RAW_WITH_MTP, CheckpointFactory, build_dense_model, dtype_for
from tests.fixtures import RAW_DRAFTS

FAMILY_NAMES = sorted({cls.name for cls in FAMILIES.values()})
TEXT = "The printing press spread books across Europe, and reading spread with them. " * 20


def fixture_layout(family: str) -> str | None:
    """The first raw fixture layout whose config is of `family`, if any."""
    for layout in RAW_WITH_MTP:
        if family_for(RAW_DRAFTS[layout](0, 512, "float32").config).name == family:
            return layout
    return None


def test_every_family_with_a_head_has_a_model_to_train() -> None:
    shipped = {name for name in FAMILY_NAMES if FAMILIES[name].ships_head}
    assert shipped and all(fixture_layout(name) for name in shipped)


# Gemma 4 drafts with a separate assistant checkpoint (issue 29), which train-head does not
# train, and the assistant is itself a drafter: neither is a model to give a head to.
TRAINABLE = [name for name in FAMILY_NAMES if not name.startswith("gemma4")]


@pytest.mark.parametrize("family", TRAINABLE)
def test_train_head_output_passes_check(
    family: str, checkpoint: CheckpointFactory, tmp_path: Path
) -> None:
    layout = fixture_layout(family)
    if layout is not None:
        model = checkpoint(layout, dtype=dtype_for(layout), with_mtp=False)
    else:
        model = build_dense_model(tmp_path / "model", family)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    settings = TrainSettings(
        steps=2,
        batch_size=2,
        seq_len=8,
        warmup=0,
        eval_every=2,
        heldout_prompts=("Hello",),
        heldout_tokens=4,
        data=DataSpec(files=(str(corpus),)),
    )
    result = train_head(model, settings=settings)
    assert result.family == family and result.head is not None
    summary = result.to_json()
    out = write_trained_head(
        Path(model),
        result.head,
        output=tmp_path / "trained",
        dtype=result.dtype,
        hidden=result.hidden,
        training={k: v for k, v in summary.items() if k not in ("history", "output")},
    )
    checked = check_checkpoint(str(out), probe=False)
    failed = [c for c in checked["checks"] if c["status"] == "fail"]
    assert checked["verdict"] == "pass", failed

    model, tokenizer = load(str(out))
    prompt = tokenizer.encode("The history of the printing press")
    steps = zip(generate_step(mx.array(prompt), model), range(6), strict=False)
    stock = [int(t) for (t, _), _ in steps]
    m = load_model(out)
    assert m.head is not None
    drafted = generate(m, prompt, max_tokens=6, depth=2, adaptive=False)
    # generate stops at an end-of-sequence token; mlx-lm's generate_step does not.
    end = next((i for i, t in enumerate(stock) if t in tokenizer.eos_token_ids), len(stock))
    assert drafted.tokens == stock[:end] and drafted.drafted > 0
