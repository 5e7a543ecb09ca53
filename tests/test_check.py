"""`mtpkit check`: structural checks, the verdict rule, JSON, JUnit and the CLI.

The probes' numbers come from a stand-in measurement here (the rule is pure arithmetic on
per-prompt acceptances); `test_check_probes.py` runs the real runtime on the trained example.
"""

from __future__ import annotations

import json
import random
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.check.junit import junit_xml
from mtpkit.check.measure import EARLY_STOP_PROMPTS
from mtpkit.check.probes import Measurement, Variant, diagnose, single_variants
from mtpkit.check.verdict import CHECKS, check_checkpoint
from mtpkit.cli.app import app
from mtpkit.cli.options import EXIT_FAILED_REQUIREMENT
from mtpkit.core.prompts import BUILTIN_PROMPTS, read_prompts
from tests import hub_server
from tests.checkpoints import build_checkpoint
from tests.hub_server import HubStandIn

hub = hub_server.hub

runner = CliRunner()

JSON_KEYS = {"source", "revision", "verdict", "checks", "acceptance", "best_variant", "moe_dtype"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("check")
    return {
        "qwen3_5": build_checkpoint("qwen3_5", root / "qwen3_5"),
        "deepseek_v3": build_checkpoint("deepseek_v3", root / "deepseek_v3", dtype="float32"),
        "stripped": build_checkpoint("stripped", root / "stripped"),
        "mlx_inline": build_checkpoint("mlx_inline", root / "mlx_inline", dtype="float32"),
    }


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def statuses(result: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in result["checks"]}


def detail(result: dict, name: str) -> str:
    return next(c["detail"] for c in result["checks"] if c["name"] == name)


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config, indent=2))


# --------------------------------------------------------------------------- structural


@pytest.mark.parametrize("layout", ["qwen3_5", "deepseek_v3", "mlx_inline"])
def test_healthy_layouts_pass_structure(built, layout):
    result = check_checkpoint(str(built[layout]), probe=False)
    assert set(result) == JSON_KEYS
    assert result["verdict"] == "pass", result["checks"]
    assert list(statuses(result))[:7] == list(CHECKS)[:7]
    assert result["acceptance"] is None and result["best_variant"] is None


def test_stripped_head_fails_head_present_with_fix(built):
    result = check_checkpoint(str(built["stripped"]), probe=True)
    assert result["verdict"] == "fail"
    assert statuses(result)["head_present"] == "fail"
    assert "--mtp-only --into" in detail(result, "head_present")
    # Nothing to probe: no acceptance is claimed, the case is reported as skipped.
    assert statuses(result)["acceptance"] == "skip"
    assert result["acceptance"] is None


def test_quantization_override_not_matching_tensors_fails(built, tmp_path):
    path = copy_of(built["mlx_inline"], tmp_path / "ckpt")
    layer = "language_model.mtp.layers.0.self_attn.q_proj"

    def wrong_bits(config):
        config["quantization"][layer] = {"group_size": 64, "bits": 8}
        config["quantization_config"][layer] = {"group_size": 64, "bits": 8}

    edit_config(path, wrong_bits)
    result = check_checkpoint(str(path), probe=False)
    assert result["verdict"] == "fail"
    assert statuses(result)["quantization"] == "fail"
    message = detail(result, "quantization")
    assert layer in message and "4 bits/group 64" in message and "says 8 bits" in message


def test_quantization_default_not_matching_tensors_fails(built, tmp_path):
    path = copy_of(built["mlx_inline"], tmp_path / "ckpt")

    def wrong_default(config):
        for key in ("quantization", "quantization_config"):
            config[key]["group_size"] = 128

    edit_config(path, wrong_default)
    result = check_checkpoint(str(path), probe=False)
    assert statuses(result)["quantization"] == "fail"
    assert "config default says 4 bits/group 128" in detail(result, "quantization")


def test_quantized_layer_marked_unquantized_fails(built, tmp_path):
    path = copy_of(built["mlx_inline"], tmp_path / "ckpt")
    layer = "language_model.mtp.fc"

    def unquantized(config):
        config["quantization"][layer] = False
        config["quantization_config"][layer] = False

    edit_config(path, unquantized)
    result = check_checkpoint(str(path), probe=False)
    assert statuses(result)["quantization"] == "fail"
    assert f"says {layer} is not quantized" in detail(result, "quantization")


def test_missing_quantization_entry_fails(built, tmp_path):
    path = copy_of(built["mlx_inline"], tmp_path / "ckpt")
    edit_config(path, lambda c: (c.pop("quantization"), c.pop("quantization_config")))
    result = check_checkpoint(str(path), probe=False)
    assert statuses(result)["quantization"] == "fail"
    assert statuses(result)["backbone_loads"] == "fail"


def test_manifest_inconsistent_with_tensors_fails(built, tmp_path):
    path = copy_of(built["mlx_inline"], tmp_path / "ckpt")
    (path / "mtp").mkdir()
    manifest = {
        "format": "mtpkit",
        "family": "qwen3_5_moe",
        "prefix": "language_model.mtp.",
        "num_layers": 1,
        "rmsnorm_weight_format": "mlx_gamma",
        "hidden": "post_norm",
        "concat_order": "embedding_first",
        "mtp_quantization": None,
    }
    (path / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    result = check_checkpoint(str(path), probe=False)
    assert statuses(result)["manifest"] == "fail"
    assert "not quantized but its tensors carry .scales" in detail(result, "manifest")
    # The manifest is quantization metadata too.
    assert statuses(result)["quantization"] == "fail"

    manifest["mtp_quantization"] = {"bits": 4, "group_size": 64}
    (path / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    assert statuses(check_checkpoint(str(path), probe=False))["manifest"] == "pass"

    manifest["num_layers"] = 2
    (path / "mtp" / "manifest.json").write_text(json.dumps(manifest))
    result = check_checkpoint(str(path), probe=False)
    assert "num_layers=2 but the config declares 1" in detail(result, "manifest")


def test_undeclared_head_fails_head_declared(built, tmp_path):
    path = copy_of(built["qwen3_5"], tmp_path / "ckpt")
    edit_config(path, lambda c: c["text_config"].pop("mtp_num_hidden_layers"))
    result = check_checkpoint(str(path), probe=False)
    assert statuses(result)["head_declared"] == "fail"


def test_probe_cases_are_skipped_not_dropped_when_structure_fails(built, tmp_path):
    """CI dashboards keep every case: the probe checks are reported as skipped."""
    from mtpkit.check.verdict import PROBE_CHECKS

    path = copy_of(built["qwen3_5"], tmp_path / "ckpt")
    edit_config(path, lambda c: c["text_config"].pop("mtp_num_hidden_layers"))
    report = tmp_path / "report.xml"
    result = runner.invoke(app, ["check", str(path), "--json", "--junit", str(report)])
    assert result.exit_code == EXIT_FAILED_REQUIREMENT
    data = json.loads(result.stdout)
    assert data["verdict"] == "fail"
    assert [c["status"] for c in data["checks"] if c["name"] in PROBE_CHECKS] == ["skip"] * 5
    assert all("head_declared" in detail(data, name) for name in PROBE_CHECKS)
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite.get("skipped") == "5" and suite.get("tests") == str(len(data["checks"]))
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert skipped == list(PROBE_CHECKS)


def test_missing_shard_fails_index(built, tmp_path):
    path = copy_of(built["qwen3_5"], tmp_path / "ckpt")
    (path / "model-00001-of-00002.safetensors").unlink()
    result = check_checkpoint(str(path), probe=False)
    assert statuses(result)["index"] == "fail"
    assert statuses(result)["backbone_loads"] == "fail"


# --------------------------------------------------------------------------- the verdict rule

SHIPPED = Variant(0, "post_norm", "embedding_first")
PROMPTS = 16


def fake(levels: dict[str, float], *, noise: float = 0.03, seed: int = 0):
    """A measurement stand-in: each variant's per-prompt acceptance around a level."""
    variants = {"shipped": SHIPPED, **single_variants(SHIPPED)}
    calls: list[Variant] = []

    def measure_variant(v: Variant) -> Measurement:
        calls.append(v)
        key = next((k for k, known in variants.items() if known == v), "other")
        level = levels.get(key, levels.get("other", 0.02))
        # Prompt difficulty is shared by every variant (paired), plus per-variant noise.
        values = []
        for i in range(PROMPTS):
            rng = random.Random(f"{seed}-{i}-{v}")
            difficulty = random.Random(f"{seed}-{i}").uniform(-0.1, 0.1)
            values.append(min(1.0, max(0.0, level + difficulty + rng.gauss(0, noise))))
        return Measurement(v, values)

    return measure_variant, calls


HEALTHY = {
    "shipped": 0.60,
    "norm_shift=-1": 0.02,
    "norm_shift=+1": 0.57,
    "hidden": 0.55,
    "concat_order": 0.03,
}


def by_name(diagnosis) -> dict[str, str]:
    return {c.name: c.status for c in diagnosis.checks}


def test_rule_passes_a_healthy_head():
    measure, calls = fake(HEALTHY)
    d = diagnose(measure, SHIPPED)
    assert set(by_name(d).values()) == {"pass"}
    assert d.best.variant == SHIPPED
    assert len(calls) == 5


def test_rule_healthy_head_whose_double_shift_is_as_good_passes():
    # RMSNorm is nearly scale-free: a double shift may cost nothing at all.
    for seed in range(20):
        measure, _ = fake({**HEALTHY, "norm_shift=+1": 0.60}, seed=seed)
        assert by_name(diagnose(measure, SHIPPED))["norm_shift"] == "pass", seed


def test_rule_names_a_double_shift():
    # Shipped carries an extra +1: removing it gains only a few points, consistently.
    levels = {"shipped": 0.56, "norm_shift=-1": 0.60, "norm_shift=+1": 0.52, "hidden": 0.50}
    measure, _ = fake(levels, noise=0.02)
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["norm_shift"] == "fail"
    assert by_name(d)["acceptance"] == "pass"
    detail_text = next(c.detail for c in d.checks if c.name == "norm_shift")
    assert "shifted twice" in detail_text and "mtpkit convert" in detail_text
    assert d.best.variant.norm_shift == -1


def test_rule_names_a_double_shift_that_costs_nothing():
    # Too close to tell apart by acceptance; but a correctly shifted head would collapse at -1.
    levels = {"shipped": 0.60, "norm_shift=-1": 0.60, "norm_shift=+1": 0.60, "hidden": 0.55}
    measure, _ = fake(levels)
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["norm_shift"] == "fail"
    assert "keeps working" in next(c.detail for c in d.checks if c.name == "norm_shift")
    assert d.best.variant.norm_shift == -1
    # Plain norms (DeepSeek, GLM, MiMo) are never shifted: there, only a clear gain counts.
    d = diagnose(measure, SHIPPED, zero_centred=False)
    assert by_name(d)["norm_shift"] == "pass"


def test_rule_names_a_missing_shift():
    levels = {"shipped": 0.02, "norm_shift=+1": 0.60, "norm_shift=-1": 0.01}
    measure, _ = fake(levels)
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["norm_shift"] == "fail"
    assert by_name(d)["acceptance"] == "fail"
    assert by_name(d)["head_matches_trunk"] == "pass"
    assert "shift missing" in next(c.detail for c in d.checks if c.name == "norm_shift")
    assert d.best.variant.norm_shift == 1


def test_rule_names_a_swapped_concat_order():
    levels = {"shipped": 0.03, "concat_order": 0.60}
    measure, _ = fake(levels)
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["concat_order"] == "fail"
    assert by_name(d)["norm_shift"] == "pass"
    assert d.best.variant.concat_order == "hidden_first"


def test_rule_small_hidden_gain_only_warns():
    levels = {**HEALTHY, "hidden": 0.63}
    measure, _ = fake(levels, noise=0.005)
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["hidden"] == "warn"
    assert d.best.variant == SHIPPED


def test_rule_settles_an_undecided_gain_on_reserve_prompts():
    # The other hidden variant gains 6 points, too noisy to be sure on 16 prompts.
    def per_prompt(v: Variant) -> list[float]:
        if v == SHIPPED:
            return [0.6] * PROMPTS
        if v.hidden == "pre_norm":
            return [0.66 + (0.08 if i % 2 else -0.08) for i in range(PROMPTS)]
        return [0.02] * PROMPTS

    more: list[Variant] = []

    def measure_more(v: Variant) -> Measurement:
        more.append(v)
        return Measurement(v, per_prompt(v))

    measure = lambda v: Measurement(v, per_prompt(v))  # noqa: E731
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["hidden"] == "warn"
    assert "inconclusive" in next(c.detail for c in d.checks if c.name == "hidden")

    d = diagnose(measure, SHIPPED, measure_more=measure_more)
    assert more == [SHIPPED, Variant(0, "pre_norm", "embedding_first")]
    assert by_name(d)["hidden"] == "fail"
    assert "--hidden pre_norm" in next(c.detail for c in d.checks if c.name == "hidden")
    assert "over 32 prompts" in next(c.detail for c in d.checks if c.name == "acceptance")


def test_rule_blames_the_trunk_when_no_variant_helps():
    measure, calls = fake({"other": 0.03, "shipped": 0.03})
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["head_matches_trunk"] == "fail"
    assert "not trained with this trunk" in next(
        c.detail for c in d.checks if c.name == "head_matches_trunk"
    )
    # Every combination of shift, hidden variant and concat order was tried.
    assert len(set(calls)) == 12
    assert by_name(d)["norm_shift"] == "pass"


def test_rule_does_not_name_a_variant_that_leaves_the_head_unusable():
    # A foreign head's variants all sit near chance; one may be consistently a little higher.
    measure, _ = fake({"other": 0.03, "shipped": 0.03, "norm_shift=-1": 0.08}, noise=0.005)
    d = diagnose(measure, SHIPPED)
    assert by_name(d)["norm_shift"] == "warn"
    assert by_name(d)["head_matches_trunk"] == "fail"


def test_rule_finds_two_conventions_wrong_at_once():
    both = Variant(1, "post_norm", "hidden_first")
    variants = {SHIPPED: 0.02, both: 0.6}

    def measure_variant(v: Variant) -> Measurement:
        return Measurement(v, [variants.get(v, 0.02) + 0.001 * i for i in range(PROMPTS)])

    d = diagnose(measure_variant, SHIPPED)
    assert by_name(d)["head_matches_trunk"] == "pass"
    assert by_name(d)["norm_shift"] == "fail" and by_name(d)["concat_order"] == "fail"
    assert d.best.variant == both


# --------------------------------------------------------------------------- probes, wired


def test_probe_results_reach_the_json(built, monkeypatch):
    seen = []

    def measure(model_dir, prompts, *, max_tokens, hidden, concat_order, norm_shift):
        seen.append((len(prompts), hidden, concat_order, norm_shift))
        if concat_order == "hidden_first" or norm_shift < 0:
            return 0.02
        return 0.5 - 0.02 * norm_shift - (0.05 if hidden else 0.0)

    result = check_checkpoint(str(built["mlx_inline"]), measure=measure, max_tokens=8)
    assert result["verdict"] == "pass", result["checks"]
    assert result["acceptance"] == pytest.approx(0.5)
    assert result["best_variant"] == {
        "norm_shift": 0,
        "hidden": "post_norm",
        "concat_order": "embedding_first",
        "acceptance": 0.5,
    }
    # One call per prompt and variant, the two collapsed ones (unusable, far below the
    # shipped head) stopping early; as shipped, the runtime reads its own settings.
    assert len(seen) == 3 * len(BUILTIN_PROMPTS) + 2 * EARLY_STOP_PROMPTS
    assert (1, None, None, 0.0) in seen and (1, "pre_norm", None, 0.0) in seen


# --------------------------------------------------------------------------- the Hub


def test_hub_repo_is_checked_from_headers_without_probing(hub: HubStandIn, built):
    hub.add_repo("org/stripped", built["stripped"])
    hub.add_repo("org/inline", built["mlx_inline"])
    out = runner.invoke(app, ["check", "org/stripped", "--json"])
    assert out.exit_code == EXIT_FAILED_REQUIREMENT, out.output
    result = json.loads(out.stdout)
    assert statuses(result)["head_present"] == "fail"
    assert "backbone_loads" not in statuses(result)
    assert "pass --probe" in out.stderr

    hub.reset_counters()
    result = check_checkpoint("org/inline", revision="main")
    assert result["verdict"] == "pass" and result["revision"] == "main"
    assert result["acceptance"] is None
    # Headers only: a bounded probe of each shard, never the shard.
    for shard in built["mlx_inline"].glob("*.safetensors"):
        assert (
            hub.bytes_served.get(f"org/inline/{shard.name}", 0) <= 64 * 1024 < shard.stat().st_size
        )


def flat_measure(calls: list[str]):
    def measure(model_dir, prompts, *, max_tokens, hidden, concat_order, norm_shift):
        calls.append(model_dir)
        if concat_order or norm_shift < 0:
            return 0.02
        return 0.5 - 0.02 * norm_shift - (0.05 if hidden else 0.0)

    return measure


def test_hub_probe_downloads_an_mlx_repo_into_the_cache(
    hub: HubStandIn, built, tmp_path, monkeypatch
):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    sha = hub.add_repo("org/inline", built["mlx_inline"])
    calls: list[str] = []
    result = check_checkpoint("org/inline", probe=True, measure=flat_measure(calls), max_tokens=4)
    assert result["verdict"] == "pass", result["checks"]
    assert statuses(result)["backbone_loads"] == "pass"
    # Downloaded once, into the Hugging Face cache that `generate` also reads.
    (cached,) = {Path(c) for c in calls}
    assert cached.name == sha and cached.parent.name == "snapshots"
    assert (cached / "config.json").exists()
    assert not (tmp_path / "cache" / "check").exists()
    # A second run reuses the cache: no shard is downloaded again.
    hub.reset_counters()
    check_checkpoint("org/inline", probe=True, measure=flat_measure([]), max_tokens=4)
    for shard in built["mlx_inline"].glob("*.safetensors"):
        assert hub.bytes_served.get(f"org/inline/{shard.name}", 0) <= 64 * 1024


def test_hub_probe_converts_a_raw_repo_into_the_cache(
    hub: HubStandIn, built, tmp_path, monkeypatch
):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    sha = hub.add_repo("org/raw", built["qwen3_5"])
    calls: list[str] = []
    result = check_checkpoint("org/raw", probe=True, measure=flat_measure(calls), max_tokens=4)
    assert result["verdict"] == "pass", result["checks"]
    cached = tmp_path / "cache" / "check" / f"org--raw--{sha}"
    assert set(calls) == {str(cached)}
    assert json.loads((cached / "mtp" / "manifest.json").read_text())["format"] == "mtpkit"


# --------------------------------------------------------------------------- reports and CLI


def test_junit_parses_and_marks_failures(built):
    result = check_checkpoint(str(built["stripped"]), probe=False)
    root = ET.fromstring(junit_xml(result))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [c["name"] for c in result["checks"]]
    failed = {c.get("name") for c in cases if c.find("failure") is not None}
    assert failed == {c["name"] for c in result["checks"] if c["status"] == "fail"}
    assert int(suite.get("failures")) == len(failed) and int(suite.get("tests")) == len(cases)


def test_cli_fail_exits_3_with_json_and_junit(built, tmp_path):
    report = tmp_path / "reports" / "check.xml"
    out = runner.invoke(app, ["check", str(built["stripped"]), "--json", "--junit", str(report)])
    assert out.exit_code == EXIT_FAILED_REQUIREMENT, out.output
    result = json.loads(out.stdout)
    assert set(result) == JSON_KEYS and result["verdict"] == "fail"
    ET.parse(report)


def test_cli_pass_exits_0_with_table(built):
    out = runner.invoke(app, ["check", str(built["qwen3_5"]), "--no-probe"])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert any("head_present" in line and "pass" in line for line in lines)
    assert "verdict: pass (no probes run)" in lines
    assert not any("fail" in line for line in lines)


def test_cli_user_errors_exit_1(tmp_path):
    report = tmp_path / "error.xml"
    out = runner.invoke(app, ["check", str(tmp_path / "nope"), "--junit", str(report)])
    assert out.exit_code == 1
    assert out.stderr.startswith("Error: ")
    assert out.stdout == ""
    # CI still gets a report that says why.
    error = ET.parse(report).getroot().find("testsuite/testcase/error")
    assert error is not None and "no such directory" in error.get("message")
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    out = runner.invoke(app, ["check", str(tmp_path), "--prompts", str(empty)])
    assert out.exit_code == 1 and "holds no prompts" in out.stderr


def test_read_prompts(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\ndef f(x):\n    return x\n\n\nlast\n")
    assert read_prompts(text) == ["first prompt", "def f(x):\n    return x", "last"]
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps(["a", " ", "b"]))
    assert read_prompts(listed) == ["a", "b"]


def test_check_of_a_dense_model_without_a_head_advises_train_head(tmp_path):
    """Llama ships no head to convert: the fix is train-head, as generate says (issue 32, 9)."""
    from typer.testing import CliRunner

    from mtpkit.cli.app import app
    from tests.checkpoints import build_dense_model

    model = build_dense_model(tmp_path / "llama", "llama")
    result = CliRunner().invoke(app, ["check", str(model), "--no-probe", "--json"])
    [declared] = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "head_declared"]
    assert declared["detail"] == (
        "the config declares no MTP layers (num_nextn_predict_layers) and there are no MTP "
        f"tensors: not an MTP checkpoint; llama models ship none: train one with `mtpkit "
        f"train-head {model} -o OUT`"
    )
# --------------------------------------------------------------------------- probing prompt by prompt


def per_prompt_measure(levels: dict[str, float], ends_at_once: set[str], calls: list[tuple]):
    """A stand-in for the runtime's measurement of one prompt: None where the text ends
    before any draft (the same under every variant: greedy verification is lossless)."""
    variants = {"shipped": SHIPPED, **single_variants(SHIPPED)}

    def measure(model_dir, prompts, *, max_tokens, hidden, concat_order, norm_shift):
        v = Variant(int(norm_shift), hidden or SHIPPED.hidden, concat_order or SHIPPED.concat_order)
        key = next((k for k, known in variants.items() if known == v), "other")
        calls.append((key, prompts[0]))
        if prompts[0] in ends_at_once:
            return None
        i = int(prompts[0].split()[-1])
        difficulty = random.Random(f"d{i}").uniform(-0.1, 0.1)
        return min(
            1.0,
            max(
                0.0, levels.get(key, 0.02) + difficulty + random.Random(f"{key}{i}").gauss(0, 0.03)
            ),
        )

    return measure


def probe_fake(measure, prompts: list[str], log: list[str]):
    from mtpkit.check.measure import probe_directory

    return probe_directory(
        Path("model"),
        SHIPPED,
        prompts,
        measure=measure,
        reserve=[],
        min_acceptance=0.2,
        max_tokens=8,
        zero_centred=True,
        log=log.append,
    )


HEALTHY_HEAD = {
    "shipped": 0.66,
    "norm_shift=-1": 0.0,
    "norm_shift=+1": 0.51,
    "hidden": 0.63,
    "concat_order": 0.05,
}


def test_a_prompt_ended_before_any_draft_is_left_out() -> None:
    """A prompt the model ends at once says nothing about the head: it is left out of every
    variant's measurement (it scored 0% for each, which diluted acceptance and gains)."""
    prompts = [f"prompt {i}" for i in range(16)]
    ends = {prompts[3], prompts[9]}
    calls: list[tuple] = []
    log: list[str] = []
    d = probe_fake(per_prompt_measure(HEALTHY_HEAD, ends, calls), prompts, log)
    assert len(d.measurements[0].per_prompt) == 14
    assert [p for k, p in calls if k != "shipped" and p in ends] == []
    without: list[tuple] = []
    alone = probe_fake(
        per_prompt_measure(HEALTHY_HEAD, set(), without), sorted(set(prompts) - ends), []
    )
    assert d.acceptance == pytest.approx(alone.acceptance)
    assert "2 of the prompts ended before any draft: left out" in log


def test_a_collapsed_variant_stops_early_with_the_same_verdict(monkeypatch) -> None:
    """Variants that collapse a healthy head (swapped inputs, norms without their +1) stop
    after EARLY_STOP_PROMPTS prompts; every check reads as when they ran on all 16."""
    import mtpkit.check.measure as measure_module

    prompts = [f"prompt {i}" for i in range(16)]
    calls: list[tuple] = []
    d = probe_fake(per_prompt_measure(HEALTHY_HEAD, set(), calls), prompts, [])
    counts = {k: sum(1 for key, _ in calls if key == k) for k in HEALTHY_HEAD}
    assert counts == {
        "shipped": 16,
        "norm_shift=-1": measure_module.EARLY_STOP_PROMPTS,
        "norm_shift=+1": 16,
        "hidden": 16,
        "concat_order": measure_module.EARLY_STOP_PROMPTS,
    }
    monkeypatch.setattr(measure_module, "EARLY_STOP_PROMPTS", 10**6)
    full = probe_fake(per_prompt_measure(HEALTHY_HEAD, set(), []), prompts, [])
    assert [(c.name, c.status) for c in d.checks] == [(c.name, c.status) for c in full.checks]
    assert d.best.variant == full.best.variant == SHIPPED
    assert all(c.status == "pass" for c in d.checks)


def test_an_unusable_variant_that_keeps_up_runs_on_every_prompt() -> None:
    """A variant below --min-acceptance but not below the shipped head (a weak head) is
    measured in full: only a variant both unusable and collapsed stops early."""
    weak = {k: 0.1 for k in [*HEALTHY_HEAD, "other"]}
    calls: list[tuple] = []
    probe_fake(per_prompt_measure(weak, set(), calls), [f"prompt {i}" for i in range(16)], [])
    assert sum(1 for key, _ in calls if key == "concat_order") >= 16
