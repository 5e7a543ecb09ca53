"""Sampling with MTP keeps the backbone's distribution (exact rejection sampling).

Both tests compare empirical frequencies with exact probabilities by a chi-square
statistic on a tiny vocabulary (or a top-k support), under fixed seeds, against a critical
value at p = 0.001, so a correct sampler fails about once in a thousand seeds and a biased
one (e.g. accepting every draft, or resampling from p instead of the residual) fails always.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings, rejection_sample

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def chi_square(counts: Counter, probs: dict[int, float], n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom, cells with expected count below 5 pooled."""
    cells = sorted(probs, key=lambda k: -probs[k])
    big = [c for c in cells if probs[c] * n >= 5]
    small = [c for c in cells if probs[c] * n < 5]
    stat = sum((counts[c] - probs[c] * n) ** 2 / (probs[c] * n) for c in big)
    if small:
        expected = sum(probs[c] for c in small) * n
        observed = sum(counts[c] for c in small)
        stat += (observed - expected) ** 2 / max(expected, 1e-9)
    outside = sum(v for k, v in counts.items() if k not in probs)
    assert outside == 0, f"{outside} samples outside the support"
    return stat, len(big) + (1 if small else 0) - 1


def exact_pairs(m, prompt: list[int], settings: SamplingSettings) -> dict[tuple[int, int], float]:
    """The backbone's exact joint distribution of the first two tokens under `settings`,
    by enumerating the support with plain forwards (no cache, no drafting)."""
    exact = {}
    p1 = settings.probs(m.model(mx.array(prompt)[None])[0, -1])
    for t1 in np.nonzero(np.array(p1) > 0)[0].tolist():
        p2 = settings.probs(m.model(mx.array(prompt + [t1])[None])[0, -1])
        for t2 in np.nonzero(np.array(p2) > 0)[0].tolist():
            exact[(t1, t2)] = p1[t1].item() * p2[t2].item()
    return exact


def test_rejection_sample_keeps_the_target_distribution() -> None:
    rng = np.random.default_rng(0)
    vocab = 6
    p = rng.dirichlet(np.ones(vocab), size=3).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab) * 0.5, size=2).astype(np.float32)
    q[0, 2] = 0.0  # a token the head never drafts
    q[0] /= q[0].sum()
    target, draft = mx.array(p), mx.array(q)
    mx.random.seed(1)
    n = 6000
    first: Counter = Counter()
    second: Counter = Counter()
    n_second = 0
    for _ in range(n):
        drafts = [int(rng.choice(vocab, p=q[0])), int(rng.choice(vocab, p=q[1]))]
        accepted, token = rejection_sample(target, draft, drafts)
        emitted = drafts[:accepted] + [token]
        first[emitted[0]] += 1
        if accepted >= 1:
            second[emitted[1]] += 1
            n_second += 1
    stat, dof = chi_square(first, dict(enumerate(p[0].tolist())), n)
    assert stat < CHI2_999[dof]
    stat, dof = chi_square(second, dict(enumerate(p[1].tolist())), n_second)
    assert stat < CHI2_999[dof]


@pytest.mark.parametrize(
    "depth, pipeline", [(2, False), (1, True), (1, "build")], ids=["depth2", "pipelined", "built"]
)
def test_mtp_sampling_matches_the_backbone_distribution_end_to_end(
    depth: int, pipeline: bool | str
) -> None:
    """The first two tokens sampled with drafting follow the backbone's exact joint
    distribution under top-k 3 (computed by enumerating the support). Pipelined (depth 1,
    three tokens wanted): the second round is queued before the first verdict is read, used
    when the first draft is kept and discarded (its draws thrown away) when it is not; built:
    likewise, but launched only once the first verdict keeps the draft."""
    m = load_model(EXAMPLE)  # the raw checkpoint; mlx-lm and mtpkit both read it directly
    settings = SamplingSettings(temp=1.0, top_k=3)
    prompt = m.tokenizer.encode("Return the number of")
    exact = exact_pairs(m, prompt, settings)
    assert len(exact) == 9
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts: Counter = Counter()
    drafted = accepted = pipelined = discarded = 0
    n = 500
    for seed in range(n):
        mx.random.seed(seed)
        decoder = MtpDecoder(
            m, prompt, depth=depth, sampling=settings, adaptive=False, pipeline=pipeline
        )
        pair = tuple(decoder.tokens(3 if pipeline else 2))[:2]
        pipelined += decoder.stats.pipelined
        discarded += decoder.stats.discarded
        counts[index.get(pair, -1)] += 1
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    assert 0 < accepted < drafted  # both the accept and the resample paths ran
    if pipeline:  # queued rounds were both used and discarded
        assert 0 < discarded < pipelined
    stat, dof = chi_square(counts, {index[k]: v for k, v in exact.items()}, n)
    assert stat < CHI2_999[dof]


def test_seed_reproduces_a_sampled_text_with_adaptive_drafting() -> None:
    """Adaptive drafting decides from counts, never the wall clock or a random draw: the same
    seed gives the same sampled text, however long each step took."""
    from mtpkit.speculative.generate import stream_tokens

    m = load_model(EXAMPLE)
    prompt = m.tokenizer.encode("Return the number of")
    settings = SamplingSettings(temp=0.8)
    texts = []
    for _ in range(2):
        tokens, stats = stream_tokens(m, prompt, max_tokens=48, sampling=settings, seed=7)
        texts.append(list(tokens))
        assert stats().rounds > 0
    assert texts[0] == texts[1]
