"""Drafters other than the MTP head, behind the proposer seam: a separate draft model (hybrid
targets and hybrid draft models included) and prompt lookup.

Each proof is against something independent: stock mlx-lm's plain greedy tokens, stock
mlx-lm's own speculative decoding with a draft model (`stream_generate(draft_model=...)`,
where stock can run it), a target that drafts with itself (every draft must be kept), drafts
injected right-then-wrong (every partial acceptance, every cache kind rolled back), and the
exact distribution of the first two sampled tokens.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mtpkit.convert.pipeline import convert
from mtpkit.core.errors import MtpkitError
from mtpkit.families import family_for, supported
from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.decode import MtpDecoder
from mtpkit.speculative.generate import generate
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.proposers.prompt_lookup import PromptLookupProposer, find_continuation
from tests.checkpoints import RAW_LAYOUTS, build_checkpoint, build_dense_model
from tests.fixtures import RAW_DRAFTS
from tests.injected import accepted_per_round, inject_drafts, planned_per_round
from tests.stock import stock_tokens as stock
from tests.test_generate_sampling import CHI2_999, chi_square, exact_pairs

PROMPT = list(range(5, 21))
DENSE = ("llama", "qwen2", "qwen3")  # registered families that ship no head (dense.py)
GEMMA4 = ("gemma4",)  # targets of tests/gemma4_checkpoints.py (their assistant: a drafter)


def _model_type(layout: str) -> str:
    return RAW_DRAFTS[layout](0, 64, "float32").config["model_type"]


# One raw layout per model_type the fixtures write (the first, by name).
LAYOUT_OF: dict[str, str] = {}
for _layout in RAW_LAYOUTS:
    if _layout != "stripped":
        LAYOUT_OF.setdefault(_model_type(_layout), _layout)


def target_dir(tmp: Path, family: str, seed: int = 0) -> Path:
    """A float32 MLX directory of `family` (a registered model_type)."""
    if family in DENSE:
        return build_dense_model(tmp / f"{family}-{seed}", family, seed=3 + seed)
    if family in GEMMA4:
        from tests.gemma4_checkpoints import build_target

        src = build_target(tmp / f"src-{seed}", seed=seed)
    else:
        src = build_checkpoint(LAYOUT_OF[family], tmp / f"src-{seed}", dtype="float32", seed=seed)
    out = tmp / f"mlx-{seed}"
    convert(str(src), output=out)
    return out


def with_tokenizer_of(draft: Path, target: Path, tmp: Path) -> Path:
    """A copy of `draft` with `target`'s tokenizer: its files and its class (transformers
    picks a class by model_type unless tokenizer_config.json names one; the Qwen3.5 class
    splits digits where the generic one does not)."""
    import json
    import shutil

    from mtpkit.runtime.model import load_tokenizer

    out = tmp / f"{draft.name}-as-{target.name}"
    shutil.copytree(draft, out)
    for f in target.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = type(load_tokenizer(target)._tokenizer).__name__
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def hybrid_draft(tmp: Path, target: Path, family: str) -> Path:
    """A gated-delta-net draft model of other weights sharing `target`'s tokenizer."""
    kind = "qwen3_5" if family.startswith("qwen3_5") else "qwen3_next"
    return with_tokenizer_of(target_dir(tmp, kind, seed=2), target, tmp)


def stock_tokens(path: Path, prompt: list[int], n: int) -> list[int]:
    """Stock mlx-lm's greedy tokens, no token ending them (the draft pairs never stop)."""
    return stock(path, prompt, n, eos=False)


def draft_decoder(target: Path, draft: Path, depth: int, **kwargs) -> MtpDecoder:
    m = load_model(target, with_head=False)
    proposer = ProposerFactory(m, DrafterChoice(draft_model=draft))()
    m.tokenizer.eos_token_ids = []
    return MtpDecoder(m, PROMPT, depth=depth, adaptive=False, proposer=proposer,
                      sampling=kwargs.pop("sampling", SamplingSettings()), **kwargs)  # fmt: skip


def test_every_registered_family_is_drafted_for() -> None:
    """The families below come from the registry: each has a fixture layout or is dense
    (a standalone drafter, Gemma 4's assistant, is no target: tests/test_gemma4_decode.py)."""
    families = [family_for({"model_type": t}) for t in supported()]
    canonical = {f.name for f in families if not f.standalone}
    covered = {family_for({"model_type": t}).name for t in [*LAYOUT_OF, *DENSE, *GEMMA4]}
    assert canonical <= covered, sorted(canonical - covered)


@pytest.mark.parametrize("family", sorted({*LAYOUT_OF, *DENSE, *GEMMA4}))
def test_a_target_drafting_with_itself_keeps_every_draft(tmp_path: Path, family: str) -> None:
    """The target as its own draft model (float32): every draft is the target's own greedy
    token, so every one is kept and the text is stock mlx-lm's."""
    path = target_dir(tmp_path, family)
    reference = stock_tokens(path, PROMPT, 14)
    decoder = draft_decoder(path, path, depth=3)
    assert list(decoder.tokens(14)) == reference
    assert decoder.stats.drafted > 0
    assert decoder.stats.accepted == decoder.stats.drafted
    assert decoder.stats.proposer == "draft-model"


@pytest.mark.parametrize(
    "draft_family", ["qwen3_5", "llama"], ids=["hybrid-draft", "attention-draft"]
)
def test_a_hybrid_target_with_a_hybrid_or_attention_draft_model(
    tmp_path: Path, draft_family: str
) -> None:
    """A gated-delta-net target (stock mlx-lm refuses any draft model for it) with a draft
    model of other weights: mostly rejected drafts, so every round rolls both models' caches
    back; the text stays stock's plain greedy one."""
    target = target_dir(tmp_path, "qwen3_5")
    draft = with_tokenizer_of(target_dir(tmp_path, draft_family, seed=1), target, tmp_path)
    reference = stock_tokens(target, PROMPT, 16)
    decoder = draft_decoder(target, draft, depth=2)
    assert list(decoder.tokens(16)) == reference
    assert decoder.stats.rounds > 3


@pytest.mark.parametrize("family", ["qwen3_5", "exaone_moe", "mimo_v2_flash", "nemotron_h",
                                    "bailing_moe_v3", "llama"])  # fmt: skip
def test_injected_drafts_roll_every_cache_kind_back(tmp_path: Path, family: str) -> None:
    """Drafts right up to a planned depth, then wrong, across round boundaries, for targets of
    every cache kind (gated delta nets, sliding windows, Mamba, replayed caches, KV) and a
    hybrid draft model whose own caches roll back too: exactly the planned drafts are kept
    and the text is stock's."""
    target = target_dir(tmp_path, family)
    draft = hybrid_draft(tmp_path, target, family)
    reference = stock_tokens(target, PROMPT, 40)
    decoder = draft_decoder(target, draft, depth=3)
    rights = inject_drafts(decoder, reference, [0, 3, 1, 2, 3, 0, 2, 1] * 10, 512)
    assert list(decoder.tokens(40)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights)
    assert set(accepted) == {0, 1, 2, 3}


@pytest.mark.parametrize("draft_seed", [None, 5], ids=["itself", "other-weights"])
def test_same_tokens_and_kept_drafts_as_stock_speculative_decoding(
    tmp_path: Path, draft_seed: int | None
) -> None:
    """On an attention-only target stock mlx-lm runs a draft model too: at greedy, the same
    tokens and the same number of tokens taken from the draft model."""
    target = build_dense_model(tmp_path / "target", "llama", seed=3)
    draft = (
        target
        if draft_seed is None
        else build_dense_model(tmp_path / "d", "llama", seed=draft_seed)
    )
    model, tokenizer = mlx_lm.load(str(target))
    draft_model, _ = mlx_lm.load(str(draft))
    tokenizer.eos_token_ids = []
    n = 33
    stream = mlx_lm.stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=n,
                                    draft_model=draft_model, num_draft_tokens=2)  # fmt: skip
    responses = list(stream)
    decoder = draft_decoder(target, draft, depth=2)
    assert list(decoder.tokens(n)) == [r.token for r in responses]
    assert decoder.stats.accepted == sum(r.from_draft for r in responses)


@pytest.mark.parametrize("draft_seed", [None, 5], ids=["itself", "other-weights"])
def test_an_attention_draft_model_is_trimmed_to_the_confirmed_text(
    tmp_path: Path, draft_seed: int | None
) -> None:
    """An attention-only draft model keeps the drafts it fed that the target kept and trims
    the rest, as mlx-lm trims (each round feeds it one or two tokens, never the kept drafts
    again). With drafts injected right-then-wrong (with a draft model of other weights, the
    right ones are not the ones it fed: those are fed again), its cache holds exactly the
    confirmed text: keys and values those of a fresh stock forward over the same tokens; the text
    is stock's and exactly the planned drafts are kept."""
    from mlx_lm.models.cache import make_prompt_cache

    target = build_dense_model(tmp_path / "target", "llama", seed=3)
    draft = target if draft_seed is None else build_dense_model(tmp_path / "d", "llama",
                                                                 seed=draft_seed)  # fmt: skip
    reference = stock_tokens(target, PROMPT, 40)
    decoder = draft_decoder(target, draft, depth=3)
    proposer = decoder.proposer
    assert proposer.trims
    fed_counts: list[int] = []
    feed = proposer._feed
    proposer._feed = lambda tokens: fed_counts.append(len(tokens)) or feed(tokens)
    rights = inject_drafts(decoder, reference, [0, 3, 1, 2, 3, 0, 2, 1] * 10, 512)
    assert list(decoder.tokens(40)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights) and set(accepted) == {0, 1, 2, 3}
    assert fed_counts[0] == len(PROMPT) - 1  # the prefill
    if draft_seed is None:  # every injected right draft is one it fed
        assert max(fed_counts[1:]) <= 2
    model, _ = mlx_lm.load(str(draft))
    fresh = make_prompt_cache(model)
    text = proposer.history[: proposer.fed]
    mx.eval(model(mx.array(text)[None], cache=fresh))
    for mine, theirs in zip(proposer.cache, fresh, strict=True):
        assert mine.offset == theirs.offset == len(text)
        for a, b in zip(mine.state[:2], theirs.state[:2], strict=True):  # keys, values
            n = len(text)
            np.testing.assert_allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), atol=1e-4)


def test_an_incompatible_draft_model_is_one_line(tmp_path: Path) -> None:
    target = build_dense_model(tmp_path / "target", "llama")
    other = tmp_path / "other"
    build_checkpoint("mlx_plain", other, vocab_size=320)
    m = load_model(target, with_head=False)
    with pytest.raises(MtpkitError, match=r"cannot draft for target: it has a vocabulary of") as e:
        ProposerFactory(m, DrafterChoice(draft_model=other))
    assert "\n" not in str(e.value)


def test_the_cli_names_the_drafter(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mtpkit.cli.app import app

    target = build_dense_model(tmp_path / "target", "llama")
    runner = CliRunner()
    args = ["generate", "--model", str(target), "-p", "x", "-m", "8", "--no-chat-template"]
    out = runner.invoke(app, [*args, "--draft-model", str(target), "--depth", "2", "--no-adaptive"])
    assert out.exit_code == 0, out.output
    assert "Drafter: draft model, depth 2, acceptance 100.0%" in out.stdout
    out = runner.invoke(app, [*args, "--prompt-lookup", "--json"])
    assert out.exit_code == 0, out.output
    assert '"drafter": "prompt-lookup"' in out.stdout
    out = runner.invoke(app, [*args, "--prompt-lookup", "--draft-model", str(target)])
    assert out.exit_code == 2 and "two drafters" in out.output


def test_find_continuation_takes_the_latest_longest_match() -> None:
    history = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3])
    assert find_continuation(history, 3, 2) == [7, 8]  # the latest earlier [1, 2, 3]
    assert find_continuation(history, 4, 2) == []
    assert find_continuation(np.array([4, 4]), 1, 3) == [4]


def test_prompt_lookup_accepts_on_repetitive_text_and_stays_stock(converted: Path) -> None:
    """The bundled example continues a repetitive prompt repetitively; prompt lookup drafts
    the repeats, keeps most, and the text is stock's plain greedy one (adaptive drafting,
    the default)."""
    target = converted
    m = load_model(target, with_head=False)
    prompt = m.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2,")
    reference = stock_tokens(target, prompt, 64)
    m.tokenizer.eos_token_ids = []
    result = generate(m, prompt, max_tokens=64, drafter=DrafterChoice(prompt_lookup=True))
    assert result.tokens == reference
    assert result.drafter == "prompt-lookup"
    assert result.accepted > 8 and result.accepted > result.drafted // 2


def _first_two(decoder_for, prompt: list[int], settings: SamplingSettings, n: int) -> Counter:
    counts: Counter = Counter()
    for seed in range(n):
        mx.random.seed(seed)
        counts[tuple(decoder_for().tokens(2))[:2]] += 1
    return counts


@pytest.mark.parametrize("drafter", ["draft-model", "prompt-lookup"])
def test_sampling_keeps_the_target_distribution(tmp_path: Path, drafter: str) -> None:
    """The first two tokens sampled with drafting follow the target's exact joint
    distribution under top-k 3: rejection sampling against the draft model's own
    distribution, or a one-hot one for prompt lookup's deterministic drafts."""
    target = build_dense_model(tmp_path / "target", "llama", seed=3)
    m = load_model(target, with_head=False)
    settings = SamplingSettings(temp=1.0, top_k=3)
    exact = exact_pairs(m, PROMPT, settings)
    if drafter == "draft-model":
        draft = build_dense_model(tmp_path / "draft", "llama", seed=4)
        factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
        prompt = PROMPT
    else:  # a prompt whose last token recurs: lookup proposes what followed it
        factory = ProposerFactory(m, DrafterChoice(prompt_lookup=True, prompt_lookup_min=1))
        prompt = PROMPT

    def decoder() -> MtpDecoder:
        return MtpDecoder(m, prompt, depth=2, sampling=settings, adaptive=False, proposer=factory())

    n = 400
    counts = _first_two(decoder, prompt, settings, n)
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    stat, dof = chi_square(Counter({index.get(k, -1): v for k, v in counts.items()}),
                           {index[k]: v for k, v in exact.items()}, n)  # fmt: skip
    assert stat < CHI2_999[dof]


def test_prompt_lookup_rejects_bad_n() -> None:
    with pytest.raises(MtpkitError, match="prompt-lookup-min"):
        PromptLookupProposer(512, 3, 2)


def test_a_draft_model_that_never_matches_is_switched_off(tmp_path: Path) -> None:
    """Adaptive drafting per drafter: a draft model of other weights is (almost) never right,
    so after its first rounds the decoder steps plainly; the text stays stock's, and a sampled
    run with a seed is reproduced exactly."""
    target = build_dense_model(tmp_path / "target", "llama", seed=3)
    draft = build_dense_model(tmp_path / "draft", "llama", seed=9)
    reference = stock_tokens(target, PROMPT, 64)
    m = load_model(target, with_head=False)
    factory = ProposerFactory(m, DrafterChoice(draft_model=draft))
    m.tokenizer.eos_token_ids = []
    decoder = MtpDecoder(m, PROMPT, depth=3, sampling=SamplingSettings(), adaptive=True,
                         choose_depth=True, proposer=factory())  # fmt: skip
    assert list(decoder.tokens(64)) == reference
    assert decoder.stats.rounds <= 8 and decoder.stats.plain_steps > 40
    texts = []
    for _ in range(2):
        mx.random.seed(5)
        sampled = MtpDecoder(m, PROMPT, depth=2, sampling=SamplingSettings(temp=0.8),
                             adaptive=True, proposer=factory())  # fmt: skip
        texts.append(list(sampled.tokens(32)))
    assert texts[0] == texts[1]


def test_a_new_drafter_is_its_file_and_one_line(converted: Path, monkeypatch, tmp_path) -> None:
    """`--draft-model DIR` finds its drafter through `choose.DIRECTORY_DRAFTERS`: a module
    of the package with a `KIND` and its line there is all a new drafter needs (here one
    that recognises its marker file and drafts by prompt lookup); the text stays stock's, the
    factory's name is the kind's, and every other directory still reaches the kinds after it."""
    import sys
    import types

    from mtpkit.speculative.proposers import choose
    from mtpkit.speculative.proposers.base import DrafterKind

    marker = tmp_path / "echo"
    marker.mkdir()
    (marker / "echo.json").write_text("{}")
    module = types.ModuleType("mtpkit.speculative.proposers.echo")
    module.KIND = DrafterKind(
        "echo",
        lambda spec: Path(spec) if (Path(spec) / "echo.json").exists() else None,
        lambda m, spec, where: lambda: PromptLookupProposer(1024, 1, 3),
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(choose, "DIRECTORY_DRAFTERS", ("echo", *choose.DIRECTORY_DRAFTERS))
    m = load_model(converted, with_head=False)
    prompt = m.tokenizer.encode("1, 2, 3, 1, 2, 3, 1, 2,")
    reference = stock_tokens(converted, prompt, 32)
    m.tokenizer.eos_token_ids = []
    result = generate(m, prompt, max_tokens=32, drafter=DrafterChoice(draft_model=marker))
    assert result.tokens == reference and result.accepted > 0
    assert ProposerFactory(m, DrafterChoice(draft_model=marker)).name == "echo"
    assert choose.directory_drafter(converted)[0].name == "draft-model"  # the catch-all, last
