"""Decoding a Gemma 4 target with its assistant drafting (`--draft-model ASSISTANT`).

Greedy output must be stock mlx-lm's plain greedy output on the target, token for token,
whichever output head drafts and however deep, with prompt and output past the sliding window;
the first round's drafts must be transformers' (`tests/references/gemma4_assistant.npz`, made
by `scripts/gemma4_reference.py`); sampling keeps the target's distribution.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.generate import generate
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from tests.gemma4_checkpoints import WINDOW, assistant_config, build_assistant, build_target
from tests.test_generate_sampling import CHI2_999, chi_square

REFERENCE = Path(__file__).parent / "references" / "gemma4_assistant.npz"
EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
PROMPT = [5, 17, 100, 3, 250, 42, 7, 9, 300, 11, 64, 128]  # past the window of 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    return {
        "target": build_target(root / "target"),
        "dense": build_assistant(root / "dense"),
        "masked": build_assistant(root / "masked", ordered=True),
    }


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A target and a dense assistant that both answer token 10 or 11 and agree on most
    steps, so rounds keep some drafts and reject others (`gemma4_checkpoints.two_token`)."""
    root = tmp_path_factory.mktemp("gemma4_agreeing")
    return {
        "target": build_target(root / "target", agreeing=True),
        "dense": build_assistant(root / "dense", agreeing=True),
    }


def _stock_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(path))
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(token) for token, _ in steps]


def _decoder(pair, head: str, prompt: list[int], depth: int, sampling=None) -> MtpDecoder:
    m = load_model(pair["target"], with_head=False)
    proposer = ProposerFactory(m, DrafterChoice(draft_model=pair[head]))()
    return MtpDecoder(
        m, prompt, depth=depth, sampling=sampling or SamplingSettings(temp=0.0),
        adaptive=False, proposer=proposer,
    )  # fmt: skip


@pytest.mark.parametrize("head", ["dense", "masked"])
@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_output_is_stock_mlx_lm_greedy(pair, head, depth):
    n = 3 * WINDOW
    stock = _stock_greedy(pair["target"], PROMPT, n)
    result = generate(
        str(pair["target"]), prompt=PROMPT, max_tokens=n, depth=depth, adaptive=False,
        drafter=DrafterChoice(draft_model=pair[head]),
    )  # fmt: skip
    assert result.tokens == stock[: len(result.tokens)]
    assert len(result.tokens) == n or result.finish_reason == "stop"
    assert result.drafter == "gemma4-assistant"
    assert result.drafted >= depth * 2  # the assistant drafted, round after round


def test_a_moe_target_without_shared_layers(tmp_path):
    """26B-A4B-like: no KV-shared layers (the assistant reads the last sliding and the last
    full layer of the whole stack), K-eq-V full layers with their own K/V head count."""
    from mtpkit.families import family_for
    from tests.gemma4_checkpoints import MOE_TEXT, target_config

    target = build_target(tmp_path / "moe", moe=True)
    assistant = build_assistant(tmp_path / "assistant")
    assert family_for(target_config(**MOE_TEXT)).pairing()["kv_source_layers"] == {
        "sliding_attention": 4,
        "full_attention": 5,
    }
    stock = _stock_greedy(target, PROMPT, 2 * WINDOW)
    result = generate(
        str(target), prompt=PROMPT, max_tokens=2 * WINDOW, depth=2, adaptive=False,
        drafter=DrafterChoice(draft_model=assistant),
    )  # fmt: skip
    assert result.tokens == stock
    assert result.drafted > 0


@pytest.mark.parametrize("depth", [2, 3])
def test_kept_and_rejected_drafts_leave_stock_greedy_output(agreeing, depth):
    """Rounds that keep some drafts and reject others (the target's cache rolled back, the
    assistant's next round drafting from the kept state) still give stock mlx-lm's output."""
    n = 4 * WINDOW
    stock = _stock_greedy(agreeing["target"], PROMPT, n)
    assert set(stock) <= {10, 11}
    result = generate(
        str(agreeing["target"]), prompt=PROMPT, max_tokens=n, depth=depth, adaptive=False,
        drafter=DrafterChoice(draft_model=agreeing["dense"]),
    )  # fmt: skip
    assert result.tokens == stock
    assert 0 < result.accepted < result.drafted  # kept drafts, and rejected ones
    assert result.acceptance_by_depth[1]  # rounds kept a second draft too


@pytest.mark.parametrize("head", ["dense", "masked"])
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_first_round_drafts_are_transformers(pair, head, prompt):
    """After the prompt, the assistant drafts what transformers' candidate generator drafts
    (the reference's prompt, then its bonus token: the decoder's first round starts there)."""
    ref = np.load(REFERENCE)
    tokens = ref[f"{prompt}/prompt"].tolist() + [int(ref[f"{prompt}/{head}/bonus"])]
    decoder = _decoder(pair, head, tokens, depth=3)
    list(decoder.tokens(4))
    position, drafts = decoder.stats.draft_log[0]
    assert position == len(tokens)
    assert drafts == ref[f"{prompt}/{head}/draft_tokens"].tolist()


def test_sampling_keeps_the_target_distribution(agreeing):
    """The first two sampled tokens follow the target's joint distribution (top-k 3), the
    assistant drafting from its own distribution each round, its drafts both kept and
    resampled (chi-square at p = 0.001)."""
    pair = agreeing
    settings = SamplingSettings(temp=1.0, top_k=3)
    m = load_model(pair["target"], with_head=False)
    p1 = settings.probs(m.model(mx.array(PROMPT)[None])[0, -1])
    exact = {}
    for t1 in np.nonzero(np.array(p1) > 0)[0].tolist():
        p2 = settings.probs(m.model(mx.array(PROMPT + [t1])[None])[0, -1])
        for t2 in np.nonzero(np.array(p2) > 0)[0].tolist():
            exact[(t1, t2)] = p1[t1].item() * p2[t2].item()
    keys = sorted(exact)
    index = {k: i for i, k in enumerate(keys)}
    proposer = ProposerFactory(m, DrafterChoice(draft_model=pair["dense"]))
    counts: Counter = Counter()
    drafted = accepted = 0
    n = 300
    for seed in range(n):
        mx.random.seed(seed)
        decoder = MtpDecoder(
            m, PROMPT, depth=2, sampling=settings, adaptive=False, proposer=proposer()
        )
        counts[index.get(tuple(decoder.tokens(2))[:2], -1)] += 1
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    assert 0 < accepted < drafted
    stat, dof = chi_square(counts, {index[k]: v for k, v in exact.items()}, n)
    assert stat < CHI2_999[dof]


def test_sampled_drafts_come_with_the_assistant_distribution(pair):
    decoder = _decoder(pair, "dense", PROMPT, depth=2, sampling=SamplingSettings(temp=0.7))
    decoder.prefill()
    proposal = decoder.proposer.propose(2, decoder.sampling)
    assert proposal.dists is not None and proposal.dists.shape == (2, 512)
    rows = np.array(proposal.dists)
    np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
    assert all(rows[k, d] > 0 for k, d in enumerate(proposal.drafts.tolist()))


# --------------------------------------------------------------------------- the CLI


def test_generate_cli_drafts_with_the_assistant(pair):
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(pair["target"]), "--draft-model", str(pair["masked"]),
         "--prompt", "hello world", "-m", "12", "--temp", "0", "--no-chat-template"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Generation:" in result.output
    assert "Drafter: Gemma 4 assistant, depth " in result.output


def test_an_assistant_for_another_target_is_refused(pair, tmp_path):
    other = build_assistant(
        tmp_path / "other", config={**assistant_config(), "backbone_hidden_size": 96}
    )
    m = load_model(pair["target"], with_head=False)
    with pytest.raises(MtpkitError, match="does not pair with target: the assistant drafts for"):
        ProposerFactory(m, DrafterChoice(draft_model=other))


def test_an_assistant_for_a_model_that_is_not_gemma4_is_refused(pair):
    result = CliRunner().invoke(
        app,
        ["generate", "--model", str(EXAMPLE), "--draft-model", str(pair["dense"]),
         "--prompt", "hi", "-m", "4"],
    )  # fmt: skip
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("Error: ")
    assert "drafts only for a Gemma 4 target" in lines[-1]
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- check


def test_check_an_assistant_with_its_target(pair, agreeing):
    args = ["check", str(agreeing["dense"]), "--target", str(agreeing["target"]), "-m", "8"]
    args += ["--min-acceptance", "0.1"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        ("structure", "pass"),
        ("pairing", "pass"),
        ("acceptance", "pass"),
    ]
    assert report["acceptance"] > 0.1  # measured over the probe prompts (chat-templated)
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0
    assert "verdict: pass (acceptance" in table.stdout
    # A random assistant stays far below the default minimum (20%): exit 3.
    args = ["check", str(pair["masked"]), "--target", str(pair["target"]), "-m", "8", "--json"]
    failed = CliRunner().invoke(app, args)
    assert failed.exit_code == 3
    report = json.loads(failed.stdout)
    assert report["checks"][2]["status"] == "fail" and report["acceptance"] < 0.2


def test_check_an_assistant_against_a_target_it_does_not_fit(pair):
    args = ["check", str(pair["dense"]), "--target", str(EXAMPLE), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["pairing"]["status"] == "fail"
    assert checks["pairing"]["detail"].endswith("qwen3_5 model, not a Gemma 4 target")
    assert checks["acceptance"]["status"] == "skip"


def test_check_an_assistant_without_its_target_is_an_error(pair):
    result = CliRunner().invoke(app, ["check", str(pair["dense"])])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {pair['dense']} is a Gemma 4 assistant: pass --target TARGET, the model it "
        "drafts for"
    )


def test_bench_measures_the_assistant(agreeing):
    args = ["bench", "--model", str(agreeing["target"]), "--draft-model", str(agreeing["dense"])]
    result = CliRunner().invoke(app, [*args, "--max-tokens", "8", "--trials", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["draft_model"] is None  # stock mlx-lm cannot load an assistant: no row
    (row,) = report["runs"]
    assert row["drafter"] == "gemma4-assistant" and row["depth"] == 3
    assert row["acceptance"] > 0


def test_rounds_and_accepted_count_are_transformers_assisted_generation(agreeing):
    """transformers' own assisted generation with the same pair (greedy, 3 drafts a round,
    `scripts/gemma4_reference.py`) against mtpkit's decoder: the same output, the same drafts
    at the same positions round by round, so the same accepted count. transformers' first
    round starts after the prompt's bonus token, so mtpkit's prompt includes it; its last
    round drafts fewer tokens (capped by its max length) and is compared up to there."""
    ref = np.load(REFERENCE)
    prompt, output = ref["assisted/prompt"].tolist(), ref["assisted/output"].tolist()
    decoder = _decoder(agreeing, "dense", prompt + output[:1], depth=3)
    assert list(decoder.tokens(len(output) - 1)) == output[1:]
    rounds = decoder.stats.draft_log
    positions, drafted = ref["assisted/positions"].tolist(), ref["assisted/drafts"].tolist()
    expected = list(zip(positions, drafted, strict=True))
    assert len(rounds) == len(expected)
    full = prompt + output
    accepted = {"mtpkit": 0, "transformers": 0}
    for (position, drafts), (ref_position, ref_drafts) in zip(rounds, expected, strict=True):
        ref_drafts = [d for d in ref_drafts if d >= 0]
        assert position == ref_position
        assert drafts[: len(ref_drafts)] == ref_drafts
        accepted["mtpkit"] += _kept(full, position, drafts[: len(ref_drafts)])
        accepted["transformers"] += _kept(full, position, ref_drafts)
    assert accepted["mtpkit"] == accepted["transformers"] > 0
    assert accepted["transformers"] < sum(len(d) for _, d in rounds)  # a round rejected


def _kept(sequence: list[int], position: int, drafts: list[int]) -> int:
    """How many of a round's drafts the final sequence agrees with (greedy: those kept)."""
    kept = 0
    while kept < len(drafts) and sequence[position + kept] == drafts[kept]:
        kept += 1
    return kept


def test_serve_drafts_with_the_assistant(agreeing, tmp_path):
    """`mtpkit serve --model TARGET --draft-model ASSISTANT`: a completion over token ids is
    stock mlx-lm's greedy text, and the response's `mtp` block names the assistant."""
    import httpx
    from mlx_lm import load

    from tests.serve_process import ServerProcess

    _, tokenizer = load(str(agreeing["target"]))
    expected = tokenizer.decode(_stock_greedy(agreeing["target"], PROMPT, 12))
    server = ServerProcess(
        agreeing["target"], tmp_path / "server.log", "--draft-model", str(agreeing["dense"])
    )
    try:
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=600.0)
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["text"] == expected
    assert answer["mtp"]["drafter"] == "gemma4-assistant"
    assert answer["mtp"]["drafted"] > 0
