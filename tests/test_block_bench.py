"""`mtpkit bench --random qwen3-4b`: Qwen3 dense shapes drafted by a random DFlash drafter of
the published shape, its rows at oracle blocks (issue 45, item 4).

The shapes are built narrowed (hidden 128, a 1024-token vocabulary, two layers) so that each
test takes seconds; the layer kinds, the tied or separate lm_head, the quantization, the
drafter's five layers, its block of 16 and its five taps are the table's. Greedy output is
held to stock mlx-lm's own greedy decoding on a fresh load of the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from typer.testing import CliRunner

from mtpkit.bench import shapes
from mtpkit.bench.random_drafter import build_random_dflash, dflash_config, drafter_beside
from mtpkit.bench.shapes import SHAPES, build_random_model
from mtpkit.checkpoint.drafters import inspect_drafter
from mtpkit.cli.app import app
from mtpkit.runtime.dflash import load_dflash
from mtpkit.runtime.model import load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.speculative.oracle import OracleDrafts
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory, directory_drafter

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
NARROW = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024}  # fmt: skip
DENSE = ("qwen3-4b", "qwen3-8b")


def build(shape: str, root: Path) -> tuple[Path, Path]:
    overrides = NARROW | {"num_hidden_layers": 2}
    target = build_random_model(shape, root / shape, tokenizer_from=EXAMPLE, overrides=overrides)
    return target, build_random_dflash(target, drafter_beside(target))


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build("qwen3-4b", tmp_path_factory.mktemp("dense"))


def test_the_published_drafter_shape_for_a_36_layer_target() -> None:
    """At the table's shapes (not built: seconds, not minutes) the drafter is z-lab's:
    the target's widths, 5 layers, block 16, mask 151669, taps [1, 9, 17, 25, 33]."""
    for shape in DENSE:
        target = SHAPES[shape]
        config = dflash_config(target)
        assert config["dflash_config"] == {"mask_token_id": 151669,
                                           "target_layer_ids": [1, 9, 17, 25, 33]}  # fmt: skip
        assert (config["num_hidden_layers"], config["block_size"]) == (5, 16)
        assert config["num_target_layers"] == 36
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                    "num_key_value_heads", "vocab_size", "rope_theta"):  # fmt: skip
            assert config[key] == target[key], key
    assert SHAPES["qwen3-4b"]["tie_word_embeddings"]
    assert not SHAPES["qwen3-8b"]["tie_word_embeddings"]


@pytest.mark.parametrize("shape", DENSE)
def test_each_dense_shape_loads_in_stock_mlx_lm_and_its_drafter_is_dflash(
    shape: str, tmp_path: Path
) -> None:
    target, drafter = build(shape, tmp_path)
    config = json.loads((target / "config.json").read_text())
    for key, value in SHAPES[shape].items():  # the table's, where not narrowed
        assert config[key] == (NARROW | {"num_hidden_layers": 2}).get(key, value), key
    assert config["quantization"]["bits"] == 4 and not (target / "mtp").exists()
    stock, _ = mlx_lm.load(str(target))
    assert type(stock).__module__ == "mlx_lm.models.qwen3" and len(stock.layers) == 2
    assert ("lm_head" in stock) != SHAPES[shape]["tie_word_embeddings"]

    kind, _ = directory_drafter(drafter)
    assert kind.name == "dflash"
    report = inspect_drafter(str(drafter), target=str(target))
    assert report["format"] == "dflash" and report["problems"] == []
    assert report["drafter"]["quantized"] and report["drafter"]["block_size"] == 16
    assert report["drafter"]["target_layer_ids"] == [0, 0, 0, 1, 1]  # five taps, scaled
    assert report["drafter"]["mask_token_id"] == 1023  # the narrowed vocabulary's last id
    assert load_dflash(drafter).layout.max_drafts == 15


def test_oracle_blocks_keep_the_plan_and_stocks_greedy_text(qwen3_4b: tuple[Path, Path]) -> None:
    """The drafter's pass runs at depth 8 (past the head's 4), its block replaced by the
    plan at 0.8 per position: each depth keeps near 0.8 of what it drafts and the text is
    stock mlx-lm's greedy continuation, token for token."""
    target, drafter = qwen3_4b
    n = 64
    stock, tokenizer = mlx_lm.load(str(target))
    tokenizer.eos_token_ids = []
    prompt = tokenizer.encode("def add(a, b):")
    reference = [r.token for r in mlx_lm.stream_generate(stock, tokenizer, mx.array(prompt),
                                                         max_tokens=n + 9)]  # fmt: skip
    m = load_model(target)
    m.tokenizer.eos_token_ids = []
    oracle = OracleDrafts(reference, len(prompt), 0.8, 1024)
    proposer = oracle.proposer(ProposerFactory(m, DrafterChoice(draft_model=drafter))())
    decoder = MtpDecoder(m, prompt, depth=8, sampling=SamplingSettings(), adaptive=False,
                         proposer=proposer)  # fmt: skip
    assert list(decoder.tokens(n)) == reference[:n]
    stats = decoder.stats
    assert stats.proposer == "dflash" and max(len(d) for _, d in stats.draft_log) == 8
    first, *deeper = stats.acceptance_by_depth(8)
    assert 0.65 <= first <= 0.95
    kept = [a for a in deeper if a is not None]
    assert kept and 0.6 <= sum(kept) / len(kept) <= 1.0


def narrowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--random qwen3-4b` built narrowed: the CLI's own path, at a test's size."""
    monkeypatch.setitem(shapes.SHAPES, "qwen3-4b", SHAPES["qwen3-4b"] | NARROW)


def test_bench_random_qwen3_measures_the_drafter_rows_at_oracle_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    narrowed(monkeypatch)
    args = ["bench", "--random", "qwen3-4b", "--random-layers", "2", "--acceptance", "0,0.8",
            "--num-draft-tokens", "4,8", "--trials", "1", "--max-tokens", "48", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["model"] == "random:qwen3-4b" and out["synthetic"]
    passes = out["drafter_costs"]
    assert set(passes) == {"4", "8"} and all(v > 0 for v in passes.values())
    runs = {(r["depth"], r["synthetic_acceptance"]): r for r in out["runs"]}
    assert set(runs) == {(4, 0.0), (8, 0.0), (4, 0.8), (8, 0.8)}
    for (k, a), run in runs.items():
        assert run["drafter"] == "dflash" and run["speedup"] > 0
        # the round: a verify of K+1 tokens and one pass, each over a 1-token forward
        expected = out["verify_costs"][str(k + 1)] + out["drafter_costs"][str(k)]
        assert run["round_cost"] == pytest.approx(expected)
        assert run["ceiling"] > 0
        if a == 0.0:
            assert run["acceptance"] == 0.0
        else:
            assert 0.6 <= run["acceptance_by_depth"][0] <= 1.0
    adaptive = {r["synthetic_acceptance"]: r for r in out["adaptive"]}
    assert set(adaptive) == {0.0, 0.8} and adaptive[0.0]["acceptance"] in (0.0, None)
    assert all(r["drafter"] == "dflash" and r["round_cost"] is None for r in adaptive.values())


def test_a_depth_past_the_block_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    narrowed(monkeypatch)
    args = ["bench", "--random", "qwen3-4b", "--random-layers", "2", "--num-draft-tokens", "16",
            "--trials", "1", "--max-tokens", "8"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("...")
    ] + ["Error: --num-draft-tokens 16: the dflash drafter proposes at most 15 tokens a round "
         "(its block): ask for fewer"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--random", "qwen3-4b", "--draft-model", "d"], "its own random DFlash drafter"),
        (["--random", "qwen3-4b", "--batch", "2"], "its own random DFlash drafter"),
        (["--random", "qwen3_5-0.8b", "--random-layers", "2"], "multiple of 4"),
        (["--random", "qwen3_5-0.8b", "--num-draft-tokens", "4,8"], "applies to a drafter"),
        (["--random", "qwen3-4b", "--num-draft-tokens", "4,x"], "positive integers"),
        (["--random", "qwen3-4b", "--draft-vocab", "512"], "qwen3-4b has no head"),
    ],
)
def test_what_bench_cannot_honour_is_a_usage_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
