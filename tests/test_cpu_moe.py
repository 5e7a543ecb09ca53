"""bf16 MoE conversions on MLX's CPU backend: experts upcast to float32 at load (`upcast.py`).

MLX's CPU GatherMM is float32-only, so without the upcast every command ends in
`[GatherMM::eval] Currently only supports float32`. The reference is independent of mtpkit's
runtime: stock `mlx_lm.load` + `mlx_lm.stream_generate` on a copy of the same conversion whose
expert tensors are stored in float32 (what "the experts in float32" means, written to disk).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from mtpkit.check.verdict import check_checkpoint
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from mtpkit.runtime import upcast
from mtpkit.speculative.generate import generate
from tests.checkpoints import CheckpointFactory

MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe")
PROMPT = [5, 17, 42, 99, 7, 250]
MAX_TOKENS = 16
# On Metal nothing is upcast: the experts run as stored.
EXPERTS = "float32" if upcast.needs_float32_experts() else "bfloat16"


@pytest.fixture(scope="module")
def bf16(checkpoint: CheckpointFactory, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each MoE family's fixture converted as stored (bf16), as a full-precision publication."""
    root = tmp_path_factory.mktemp("moe-bf16")
    out = {}
    for layout in MOE_FAMILIES:
        out[layout] = root / layout
        convert(str(checkpoint(layout, dtype="bfloat16")), output=out[layout])
    return out


def experts_in_float32(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` whose unquantized expert tensors are stored in float32."""
    shutil.copytree(model_dir, out)
    for shard in out.glob("model*.safetensors"):
        tensors = mx.load(str(shard))
        cast = {
            k: v.astype(mx.float32) if ".switch_mlp." in k and v.dtype == mx.bfloat16 else v
            for k, v in tensors.items()
        }
        mx.save_safetensors(str(shard), cast, metadata={"format": "mlx"})
    return out


def stock_tokens(model_dir: Path) -> list[int]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(model_dir))
    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=MAX_TOKENS)
    ]


@pytest.mark.parametrize("layout", MOE_FAMILIES)
def test_greedy_equals_stock_with_float32_experts(layout: str, bf16: dict, tmp_path: Path) -> None:
    reference = stock_tokens(experts_in_float32(bf16[layout], tmp_path / "f32-experts"))
    plain = generate(str(bf16[layout]), PROMPT, max_tokens=MAX_TOKENS, mtp=False)
    mtp = generate(str(bf16[layout]), PROMPT, max_tokens=MAX_TOKENS, mtp=True, depth=2)
    assert plain.tokens == reference
    assert mtp.tokens == reference and mtp.drafted > 0
    assert plain.moe_dtype == mtp.moe_dtype == EXPERTS


def test_only_the_experts_are_upcast(bf16: dict) -> None:
    import mlx_lm

    from mtpkit.runtime.model import load_model

    m = load_model(bf16["deepseek_v3"])
    ours = {k: p.dtype for k, p in tree_flatten(m.model.parameters())}
    stock = {
        k: p.dtype for k, p in tree_flatten(mlx_lm.load(str(bf16["deepseek_v3"]))[0].parameters())
    }
    changed = {k for k in stock if ours[k] != stock[k]}
    assert changed and all(".switch_mlp." in k and ours[k] == mx.float32 for k in changed)
    assert changed == {k for k in stock if ".switch_mlp." in k} or EXPERTS == "bfloat16"
    head = {k: p.dtype for k, p in tree_flatten(m.head.parameters()) if ".switch_mlp." in k}
    assert head and set(head.values()) == {getattr(mx, EXPERTS)}


@pytest.mark.parametrize("layout", MOE_FAMILIES)
def test_check_generate_bench_cli_on_bf16_moe(layout: str, bf16: dict, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["The cat sat on", "def add(a, b):"]))
    junit = tmp_path / "report.xml"
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["check", str(bf16[layout]), "--json", "--junit", str(junit),
         "--prompts", str(prompts), "--max-tokens", "8"],
    )  # fmt: skip
    assert result.exit_code in (0, 3), result.output
    report = json.loads(result.stdout)
    names = [c["name"] for c in report["checks"]]
    assert "acceptance" in names and "head_matches_trunk" in names  # the probes ran
    assert report["acceptance"] is not None and report["moe_dtype"] == EXPERTS
    assert f'<property name="moe_dtype" value="{EXPERTS}"' in junit.read_text()
    for args in (["--mtp"], ["--no-mtp"]):
        gen = runner.invoke(
            app,
            ["generate", "--model", str(bf16[layout]), "-p", "hi", "--max-tokens", "6",
             "--no-chat-template", "--json", *args],
        )  # fmt: skip
        assert gen.exit_code == 0, gen.output
        assert json.loads(gen.stdout)["moe_dtype"] == EXPERTS
    bench = runner.invoke(
        app,
        ["bench", "--model", str(bf16[layout]), "--max-tokens", "8", "--depth", "1",
         "--trials", "1", "--json"],
    )  # fmt: skip
    assert bench.exit_code == 0, bench.output
    assert json.loads(bench.stdout)["moe_dtype"] == EXPERTS


def test_check_probes_a_raw_bf16_moe_source(checkpoint: CheckpointFactory) -> None:
    # A raw checkpoint is converted as stored (bf16) into a temporary directory and probed.
    report = check_checkpoint(
        str(checkpoint("glm4_moe", dtype="bfloat16")), prompts=["The cat sat on"], max_tokens=6
    )
    assert report["acceptance"] is not None and report["moe_dtype"] == EXPERTS


@pytest.mark.skipif(not upcast.needs_float32_experts(), reason="Metal runs bf16 experts")
def test_too_large_for_memory_is_named_and_check_still_decides(
    bf16: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh copy: the runtime keeps the last loaded (already upcast) backbone.
    model = shutil.copytree(bf16["glm4_moe"], tmp_path / "glm")
    monkeypatch.setattr(upcast, "available_memory", lambda: 64 * 1024)
    runner = CliRunner()
    gen = runner.invoke(app, ["generate", "--model", str(model), "-p", "hi", "--max-tokens", "4"])
    assert gen.exit_code == 1
    assert gen.stderr.startswith("Error: moe_float32_exceeds_memory: ")
    assert len(gen.stderr.strip().splitlines()) == 1 and "Traceback" not in gen.output
    junit = tmp_path / "report.xml"
    report = check_checkpoint(str(model), junit=junit)
    acceptance = next(c for c in report["checks"] if c["name"] == "acceptance")
    assert acceptance["status"] == "warn" and "moe_float32_exceeds_memory" in acceptance["detail"]
    assert report["verdict"] == "pass" and report["acceptance"] is None  # structural checks
    assert report["moe_dtype"] is None
    assert 'name="acceptance"' in junit.read_text()


def test_quantized_experts_are_unaffected(checkpoint: CheckpointFactory, tmp_path: Path) -> None:
    import mlx_lm
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mtpkit.runtime.model import load_model

    out = tmp_path / "q4"
    convert(str(checkpoint("glm4_moe", dtype="bfloat16")), output=out, bits=4)
    result = generate(str(out), PROMPT, max_tokens=6, mtp=True)
    # mlx-lm leaves down_proj (input 32, not a multiple of group 64) unquantized: that one
    # is upcast, the quantized ones run as stored.
    assert result.moe_dtype == f"4-bit, {EXPERTS}"
    ours = dict(load_model(out).model.named_modules())
    stock = dict(mlx_lm.load(str(out))[0].named_modules())
    quantized = [k for k, m in stock.items() if isinstance(m, QuantizedSwitchLinear)]
    assert quantized
    for k in quantized:
        assert type(ours[k]) is QuantizedSwitchLinear
        assert ours[k].scales.dtype == stock[k].scales.dtype == mx.bfloat16
