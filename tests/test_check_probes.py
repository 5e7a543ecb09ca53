"""`mtpkit check` probes on the trained example: each known defect fails with its named check.

The example's head has real skill, so acceptance means something: the healthy conversion
passes, and conversions damaged the ways published ones are (head stripped, norms shifted
twice or never, projection inputs swapped, quantization metadata that does not match the
tensors, a head grafted from another model) each fail with the right check and fix.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from mtpkit.check.verdict import check_checkpoint
from mtpkit.cli.app import app
from mtpkit.cli.options import EXIT_FAILED_REQUIREMENT
from mtpkit.core.prompts import BUILTIN_PROMPTS

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
HEAD = Path("mtp") / "weights.safetensors"
# Fewer tokens than the CLI's default keep the suite fast; 16 prompts keep the statistics.
MAX_TOKENS = 32

runner = CliRunner()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mtpkit.convert.pipeline import convert

    out = tmp_path_factory.mktemp("example") / "q4"
    convert(str(EXAMPLE), output=out, bits=4)
    return out


def damaged(
    src: Path, dst: Path, edit: Callable[[dict[str, mx.array]], dict[str, mx.array]]
) -> Path:
    """A copy of `src` whose head tensors went through `edit`."""
    shutil.copytree(src, dst)
    weights = mx.load(str(dst / HEAD))
    mx.save_safetensors(str(dst / HEAD), edit(dict(weights)), metadata={"format": "mlx"})
    return dst


def is_norm(name: str, value: mx.array) -> bool:
    """Every RMSNorm weight of the head, `pre_fc_norm_hidden.weight` included."""
    return value.ndim == 1 and "norm" in name.rsplit(".", 2)[-2]


def shift_norms(by: float) -> Callable[[dict[str, mx.array]], dict[str, mx.array]]:
    def edit(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {
            k: (v.astype(mx.float32) + by).astype(v.dtype) if is_norm(k, v) else v
            for k, v in weights.items()
        }

    return edit


def swap_concat(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The projection of a head trained with the hidden state first."""
    name = next(k for k in weights if k.endswith("mtp.fc.weight"))
    fc = weights[name]
    half = fc.shape[1] // 2
    return {**weights, name: mx.concatenate([fc[:, half:], fc[:, :half]], axis=1)}


def foreign_head(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A head of the same architecture from another model: same shapes and scale, other weights."""
    mx.random.seed(1234)
    out = {}
    for k, v in weights.items():
        if v.ndim >= 2:
            std = mx.std(v.astype(mx.float32)).item()
            out[k] = (mx.random.normal(v.shape) * std).astype(v.dtype)
        else:
            out[k] = v
    return out


def statuses(result: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in result["checks"]}


def detail(result: dict, name: str) -> str:
    return next(c["detail"] for c in result["checks"] if c["name"] == name)


def check(path: Path) -> dict:
    """check on eight of the built-in prompts: greedy decoding is deterministic, and each
    damage's verdict is decided on them (the whole set: the README figures' test)."""
    return check_checkpoint(str(path), prompts=BUILTIN_PROMPTS[:8], max_tokens=MAX_TOKENS)


def test_healthy_conversion_passes(converted):
    result = check(converted)
    assert result["verdict"] == "pass", result["checks"]
    assert set(statuses(result).values()) == {"pass"}
    assert result["acceptance"] >= 0.3
    assert result["best_variant"]["norm_shift"] == 0
    assert result["best_variant"]["concat_order"] == "embedding_first"


def test_healthy_quantized_conversion_passes(quantized):
    # Quantized matmuls are slow on the CPU backend: shorter generations keep this test quick.
    result = check_checkpoint(str(quantized), prompts=BUILTIN_PROMPTS[:8], max_tokens=12)
    assert result["verdict"] == "pass", result["checks"]


def test_double_shift_fails_norm_shift(converted, tmp_path):
    result = check(damaged(converted, tmp_path / "double", shift_norms(+1.0)))
    assert result["verdict"] == "fail"
    assert statuses(result)["norm_shift"] == "fail", result["checks"]
    assert "shifted twice" in detail(result, "norm_shift")
    assert "mtpkit convert" in detail(result, "norm_shift")
    assert result["best_variant"]["norm_shift"] == -1


def test_missing_shift_fails_norm_shift(converted, tmp_path):
    result = check(damaged(converted, tmp_path / "missing", shift_norms(-1.0)))
    assert result["verdict"] == "fail"
    assert statuses(result)["norm_shift"] == "fail", result["checks"]
    assert statuses(result)["acceptance"] == "fail"
    assert "shift missing" in detail(result, "norm_shift")
    assert result["best_variant"]["norm_shift"] == 1


def test_swapped_concat_order_fails_concat_order(converted, tmp_path):
    result = check(damaged(converted, tmp_path / "swapped", swap_concat))
    assert result["verdict"] == "fail"
    assert statuses(result)["concat_order"] == "fail", result["checks"]
    assert statuses(result)["norm_shift"] == "pass"
    assert result["best_variant"]["concat_order"] == "hidden_first"


def test_head_from_another_model_fails_head_matches_trunk(converted, tmp_path):
    # A foreign head keeps almost nothing under any variant, so check tries them all on
    # every prompt: eight prompts show it at half the cost.
    path = damaged(converted, tmp_path / "foreign", foreign_head)
    result = check_checkpoint(str(path), prompts=BUILTIN_PROMPTS[:8], max_tokens=MAX_TOKENS)
    assert result["verdict"] == "fail"
    assert statuses(result)["head_matches_trunk"] == "fail", result["checks"]
    assert "not trained with this trunk" in detail(result, "head_matches_trunk")
    assert statuses(result)["norm_shift"] == "pass"
    assert statuses(result)["concat_order"] == "pass"


def test_stripped_head_fails_head_present(converted, tmp_path):
    path = tmp_path / "stripped"
    shutil.copytree(converted, path)
    shutil.rmtree(path / "mtp")
    (path / "mtp.safetensors").unlink()  # the head's copy for the other runtimes goes too
    result = check(path)
    assert statuses(result)["head_present"] == "fail"
    assert "--mtp-only --into" in detail(result, "head_present")
    assert result["acceptance"] is None


def test_quantization_metadata_not_matching_fails_quantization(quantized, tmp_path):
    path = tmp_path / "q"
    shutil.copytree(quantized, path)
    config = json.loads((path / "config.json").read_text())
    layer = "language_model.mtp.layers.0.mlp.down_proj"
    assert (
        isinstance(config["quantization"].get(layer), dict) or config["quantization"]["bits"] == 4
    )
    for key in ("quantization", "quantization_config"):
        config[key][layer] = {"group_size": 64, "bits": 8}
    (path / "config.json").write_text(json.dumps(config))
    out = runner.invoke(app, ["check", str(path), "--junit", str(tmp_path / "report.xml")])
    assert out.exit_code == EXIT_FAILED_REQUIREMENT, out.output
    assert any(
        line.startswith("│ quantization") and "fail" in line for line in out.stdout.splitlines()
    )
    root = ET.parse(tmp_path / "report.xml").getroot()
    failed = {c.get("name") for c in root.iter("testcase") if c.find("failure") is not None}
    assert "quantization" in failed


def test_cli_passes_the_raw_example_through_a_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    report = tmp_path / "junit.xml"
    out = runner.invoke(
        app, ["check", str(EXAMPLE), "--max-tokens", str(MAX_TOKENS), "--junit", str(report)]
    )
    assert out.exit_code == 0, out.output
    assert "verdict: pass (acceptance" in out.stdout
    assert "converting" in out.stderr  # a raw checkpoint is probed as `mtpkit convert` makes it
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("failures") == "0"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["verdict"] == "pass" and float(props["acceptance"]) >= 0.3
    assert list((tmp_path / "cache").iterdir()) == []  # the temporary conversion is gone


README = Path(__file__).resolve().parents[1] / "docs" / "REFERENCE.md"  # check's reference


def readme_figure(pattern: str) -> str:
    found = re.findall(pattern, README.read_text())
    assert len(found) == 1, (pattern, found)
    return found[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the figures are MLX's CPU's")
def test_readme_check_figures_are_what_check_prints(tmp_path, monkeypatch):
    """The figures the README quotes for `mtpkit check mtpkit/examples/tiny-qwen3_5` (the
    verdict rule's table and the JSON example) are the ones that command prints."""
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    result = runner.invoke(app, ["check", str(EXAMPLE), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    details = " ".join(c["detail"] for c in out["checks"])

    def printed(name: str) -> str:
        return re.search(rf"{re.escape(name)} (\d+\.\d)%", details)[1]

    shipped = f"{100 * out['acceptance']:.1f}"
    assert readme_figure(r"\(0\.0% vs (\d+\.\d)% on the example\)") == shipped
    assert printed("norms -1") == "0.0"
    plus = printed("norms +1")
    assert readme_figure(r"a few points down \((\d+\.\d)% on the example\)") == plus
    cost = f"{float(shipped) - float(plus):.1f}"
    assert readme_figure(r"double shift costs \((\d+\.\d) points on the example") == cost
    concat = readme_figure(r"swapped inputs collapse a head \((\d+\.\d)% on the example\)")
    assert concat == printed("the other concat order")
    hidden = readme_figure(r"\((\d+\.\d% vs \d+\.\d)% on the example, 75\.2%")
    assert hidden == f"{printed('the other hidden variant')}% vs {shipped}"
    assert readme_figure(r'"acceptance": (0\.\d+) \| null') == str(out["acceptance"])


def test_a_prompt_the_example_ends_at_once_gives_no_acceptance(converted):
    """The runtime's measurement of a prompt the example's base model ends at its first token
    (no draft) is None, not 0%: check leaves such prompts out rather than scoring the head
    0% on them under every variant. The same model and head serve the next prompt."""
    from mtpkit.check.measure import default_measure
    from mtpkit.core.prompts import BUILTIN_PROMPTS

    measure = default_measure()
    kwargs = {"max_tokens": MAX_TOKENS, "hidden": None, "concat_order": None, "norm_shift": 0.0}
    assert measure(str(converted), [BUILTIN_PROMPTS[4]], **kwargs) is None
    value = measure(str(converted), [BUILTIN_PROMPTS[7]], **kwargs)
    assert value is not None and 0.5 < value <= 1.0
