"""Sampling per row in a batch keeps each row's distribution, and a row's seed is its own.

On the bundled example (a trained head, so drafts are both kept and rejected), two sampled
rows with different settings and prompts share every round with a greedy row. Each sampled
row's first two tokens (the first from its prefill, the second from a drafting round:
a kept draft or a token drawn from the residual) are compared with the backbone's exact
joint distribution under the row's own settings by a chi-square statistic at p = 0.001, as
for one stream (`tests/test_generate_sampling.py`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.batch import BatchDecoder
from tests.test_generate_sampling import CHI2_999, chi_square, exact_pairs

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
SETTINGS = [SamplingSettings(temp=1.0, top_k=3), SamplingSettings(temp=0.7, top_k=2)]
TEXTS = ["Return the number of", "Create a new"]


@pytest.fixture(scope="module")
def m():
    return load_model(EXAMPLE)  # the raw checkpoint; mlx-lm and mtpkit both read it


def test_each_sampled_row_keeps_its_distribution(m) -> None:
    prompts = [m.tokenizer.encode(t) for t in TEXTS]
    greedy_prompt = m.tokenizer.encode("Open the file")
    exact = [exact_pairs(m, p, s) for p, s in zip(prompts, SETTINGS, strict=True)]
    greedy_alone = BatchDecoder(m, depth=2).generate([greedy_prompt], max_tokens=2)[0].tokens
    counts: list[Counter] = [Counter(), Counter(), Counter()]
    drafted = accepted = 0
    n = 300
    for seed in range(n):
        mx.random.seed(seed)
        decoder = BatchDecoder(m, depth=2)
        # The third row samples as the first, with drafting off (a plain step a round).
        rows = [decoder.add(p, max_tokens=2, sampling=s, depth=d) for p, s, d in
                zip([*prompts, prompts[0], greedy_prompt],
                    [*SETTINGS, SETTINGS[0], SamplingSettings()], [2, 2, 0, 2], strict=True)]  # fmt: skip
        while decoder.rows:
            decoder.step()
        for i in range(3):
            counts[i][tuple(rows[i].tokens)] += 1
        drafted += rows[0].drafted + rows[1].drafted
        accepted += rows[0].accepted + rows[1].accepted
        assert rows[3].tokens == greedy_alone and rows[2].drafted == 0
    assert 0 < accepted < drafted  # both the accept and the resample paths ran
    exact.append(exact[0])
    for i in range(3):
        index = {k: j for j, k in enumerate(sorted(exact[i]))}
        observed = Counter({index.get(k, -1): v for k, v in counts[i].items()})
        stat, dof = chi_square(observed, {index[k]: v for k, v in exact[i].items()}, n)
        assert stat < CHI2_999[dof], (i, stat, dof)


def test_a_seeded_row_samples_alike_alone_and_in_any_batch(m) -> None:
    """A row with a seed draws from its own key: the same text alone and beside other
    sampled rows (whose draws, depths and acceptances differ), whatever the global seed."""
    prompt = m.tokenizer.encode(TEXTS[0])
    others = [m.tokenizer.encode(t) for t in ("Create a new", "Open the file", "Read")]
    mx.random.seed(1)
    alone = BatchDecoder(m, depth=2).generate([prompt], max_tokens=24, sampling=SETTINGS[0],
                                              seeds=[7])[0]  # fmt: skip
    mx.random.seed(2)
    decoder = BatchDecoder(m, depth=3)  # batchmates at depths 3, 0 and 1 beside it at 2
    sampling = [SETTINGS[1], SETTINGS[0], SETTINGS[0], SamplingSettings()]
    rows = [decoder.add(p, max_tokens=24, sampling=s, seed=seed, depth=d)
            for p, s, seed, d in zip([others[0], prompt, others[1], others[2]], sampling,
                                     [3, 7, None, None], [3, 2, 0, 1], strict=True)]  # fmt: skip
    while decoder.rows:
        decoder.step()
    assert rows[1].tokens == alone.tokens and len(alone.tokens) > 4
    assert alone.accepted > 0
    mx.random.seed(1)
    other_seed = BatchDecoder(m, depth=2).generate([prompt], max_tokens=24, sampling=SETTINGS[0],
                                                   seeds=[8])[0]  # fmt: skip
    assert other_seed.tokens != alone.tokens
