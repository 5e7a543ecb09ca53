"""`convert --draft-vocab N`: the head drafts over a subset of the vocabulary, and the output
stays the model's own (greedy: stock mlx-lm's tokens; sampled: the backbone's distribution)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from tests.stock import stock_tokens
from tests.test_generate_sampling import CHI2_999, chi_square, exact_pairs

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
CORPUS = EXAMPLE / "heldout.txt"
SIZE = 160
runner = CliRunner()


@pytest.fixture(scope="module")
def subset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("draft-vocab") / "tiny"
    convert(str(EXAMPLE), output=out, draft_vocab=SIZE, draft_vocab_corpus=[str(CORPUS)])
    return out


def corpus_counts() -> Counter[int]:
    """Token counts of the corpus by transformers' own tokenizer of the model, document by
    document (blank-line separated)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(EXAMPLE))
    counts: Counter[int] = Counter()
    for doc in CORPUS.read_text(encoding="utf-8").split("\n\n"):
        if doc.strip():
            counts.update(tok.encode(doc.strip("\n"), add_special_tokens=False))
    return counts


def subset_ids(path: Path) -> list[int]:
    return mx.load(str(path / "mtp" / "draft_vocab.safetensors"))["ids"].tolist()


def test_convert_keeps_the_corpus_most_frequent_tokens(subset: Path) -> None:
    ids = subset_ids(subset)
    assert len(ids) == SIZE and ids == sorted(set(ids))
    counts = corpus_counts()
    record = json.loads((subset / "mtp" / "manifest.json").read_text())["draft_vocab"]
    assert record["source"] == "corpus" and record["size"] == SIZE
    assert record["corpus_tokens"] == sum(counts.values())
    # Every token more frequent than the least frequent kept one is kept.
    kept = [counts[i] for i in ids if i in counts]
    assert {i for i, c in counts.items() if c > min(kept)} <= set(ids)
    assert record["corpus_coverage"] == round(sum(counts[i] for i in ids) / sum(counts.values()), 4)
    from transformers import AutoTokenizer

    specials = set(AutoTokenizer.from_pretrained(str(EXAMPLE)).all_special_ids)
    assert specials and specials <= set(ids)  # special tokens are always kept


def test_subset_logits_are_the_lm_head_rows(subset: Path, tmp_path: Path) -> None:
    """The sliced lm_head equals the full one's rows, plain and quantized (-q)."""
    quantized = tmp_path / "q"
    convert(str(EXAMPLE), output=quantized, quantize=True, draft_vocab=SIZE)
    for path in (subset, quantized):
        m = load_model(path)
        vocab = m.drafting
        assert vocab.size == SIZE
        x = mx.random.normal((1, 3, m.embed(mx.array([[0]])).shape[-1]), key=mx.random.key(0))
        full = np.array(m.lm_head(x).astype(mx.float32))
        part = np.array(vocab.logits(x).astype(mx.float32))
        np.testing.assert_allclose(part, full[..., subset_ids(path)], rtol=1e-5, atol=1e-5)


def test_greedy_tokens_are_stock_mlx_lm_and_drafts_stay_in_the_subset(subset: Path) -> None:
    m = load_model(subset)
    allowed = set(subset_ids(subset))
    eos, m.tokenizer.eos_token_ids = m.tokenizer.eos_token_ids, []  # 48 tokens each
    try:
        _greedy_rounds(m, subset, allowed)
    finally:
        m.tokenizer.eos_token_ids = eos


def _greedy_rounds(m, subset: Path, allowed: set[int]) -> None:
    for text in ("Create a new event loop. You", "Define the builtin 'help'. This is a wrapper"):
        prompt = m.tokenizer.encode(text)
        decoder = MtpDecoder(m, prompt, depth=2, sampling=SamplingSettings(), adaptive=False)
        proposer = decoder.proposer
        drafted: list[int] = []
        propose = proposer.propose

        def spy(depth, sampling, propose=propose, drafted=drafted):
            proposal = propose(depth, sampling)
            drafted.extend(proposal.drafts.tolist())
            return proposal

        proposer.propose = spy
        tokens = list(decoder.tokens(48))
        assert tokens == stock_tokens(subset, prompt, 48, eos=False)
        assert drafted and set(drafted) <= allowed
        assert decoder.stats.accepted > 0


def test_sampling_keeps_the_backbone_distribution(tmp_path: Path) -> None:
    """First two tokens at top-k 3 against the exact joint distribution, with a subset that
    leaves out one of the backbone's likely first tokens (the head can never draft it)."""
    m = load_model(EXAMPLE)
    settings = SamplingSettings(temp=1.0, top_k=3)
    prompt = m.tokenizer.encode("Return the number of")
    exact = exact_pairs(m, prompt, settings)
    first = sorted({t1 for t1, _ in exact})
    out = tmp_path / "subset"
    convert(str(EXAMPLE), output=out, draft_vocab=1000)
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    ids = [i for i in range(1024) if i != first[0]][:1000]
    mx.save_safetensors(str(out / "mtp" / "draft_vocab.safetensors"), {"ids": mx.array(ids)})
    (out / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    sub = load_model(out)
    assert first[0] not in sub.drafting.ids.tolist()
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    counts: Counter = Counter()
    drafted = accepted = 0
    n = 400
    for seed in range(n):
        mx.random.seed(seed)
        decoder = MtpDecoder(sub, prompt, depth=2, sampling=settings, adaptive=False)
        counts[index.get(tuple(decoder.tokens(2))[:2], -1)] += 1
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    assert 0 < accepted < drafted
    stat, dof = chi_square(counts, {index[k]: v for k, v in exact.items()}, n)
    assert stat < CHI2_999[dof]


def test_refusals(subset: Path, tmp_path: Path) -> None:
    too_wide = runner.invoke(app, ["convert", str(EXAMPLE), "-o", str(tmp_path / "a"),
                                   "--draft-vocab", "1024", "--quiet"])  # fmt: skip
    assert too_wide.exit_code == 1
    assert "--draft-vocab 1024 must be between 1 and the vocabulary size less one" in too_wide.stderr
    assert not (tmp_path / "a").exists()
    lonely = runner.invoke(app, ["convert", str(EXAMPLE), "-o", str(tmp_path / "b"),
                                 "--draft-vocab-corpus", str(CORPUS)])  # fmt: skip
    assert lonely.exit_code == 2 and "pass both" in lonely.stderr
    missing = runner.invoke(app, ["convert", str(EXAMPLE), "-o", str(tmp_path / "c"),
                                  "--draft-vocab", "64", "--draft-vocab-corpus", "nope.txt"])  # fmt: skip
    assert missing.exit_code == 1 and "nope.txt: no such file" in missing.stderr
    # A subset made for another tokenizer is refused at load, in one line.
    other = tmp_path / "other"
    convert(str(subset), output=other, draft_vocab=SIZE)
    manifest = json.loads((other / "mtp" / "manifest.json").read_text())
    manifest["draft_vocab"]["tokenizer_sha256"] = "0" * 64
    (other / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(MtpkitError, match="made for another tokenizer"):
        load_model(other)


def test_batched_rows_draft_in_the_subset_and_are_each_stock(
    subset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of one batch draft over the subset too (`HeadRows`), greedy and sampled rows
    side by side; each greedy row is stock mlx-lm's tokens alone."""
    from mtpkit.speculative.batch import BatchDecoder
    from mtpkit.speculative.proposers.mtp_head import HeadRows

    m = load_model(subset)
    allowed = set(subset_ids(subset))
    prompts = [m.tokenizer.encode("Create a new event loop. You"), list(range(40, 24, -1))]
    decoder = BatchDecoder(m, depth=2, adaptive=False)
    head_propose = HeadRows.propose
    drafted: list[int] = []

    def spy(head, depths, sampling, keys):
        proposal = head_propose(head, depths, sampling, keys)
        drafted.extend(proposal.drafts.reshape(-1).tolist())
        for q in proposal.dists:
            if q is not None:  # a sampled row's proposal: over the whole vocabulary, in the subset
                mass = np.array(q.astype(mx.float32)).sum(axis=0)
                assert q.shape[-1] == 1024 and set(np.nonzero(mass)[0].tolist()) <= allowed
        return proposal

    monkeypatch.setattr(HeadRows, "propose", spy)
    rows = [decoder.add(p, max_tokens=24) for p in prompts]
    sampled = decoder.add(prompts[0], max_tokens=8, sampling=SamplingSettings(temp=1.0), seed=3)
    while decoder.rows:
        decoder.step()
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.tokens == stock_tokens(subset, prompt, 24)
    assert sampled.tokens and drafted and set(drafted) <= allowed
