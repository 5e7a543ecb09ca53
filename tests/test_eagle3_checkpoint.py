"""`mtpkit inspect`, `mtpkit convert`, `generate` and `bench --draft-model` on EAGLE-3
drafters in their published formats (`tests/eagle3_checkpoints.py`): what inspect reports
is what the config and tensors written say; a converted drafter drafts what the published
one drafts (bf16), and its quantized form stays exact (stock greedy tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from typer.testing import CliRunner

from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from tests.stock import stock_tokens
from tests.test_dflash import spy_drafts
from tests.test_eagle3 import PROMPT, decoder_for, pair

VOCAB_FIELDS = ("draft_vocab_size", "d2t", "t2d")


def _tensors(draft: Path) -> dict[str, mx.array]:
    return mx.load(str(draft / "model.safetensors"))


def _save(draft: Path, tensors: dict[str, mx.array]) -> None:
    mx.save_safetensors(str(draft / "model.safetensors"), tensors, metadata={"format": "pt"})


def test_inspect_names_what_the_drafter_reads(tmp_path: Path) -> None:
    """EAGLE's own format: the default layers resolved against --target, the d2t map's
    target ids, the drafter's tensors (the vocabulary map among them)."""
    target, draft = pair(tmp_path, "llama", text=4)
    ids = (np.arange(len(_tensors(draft)["d2t"])) + np.array(_tensors(draft)["d2t"])).tolist()
    result = inspect_checkpoint(str(draft), target=str(target))
    d = result["drafter"]
    assert (d["kind"], d["architecture"], d["layers"]) == ("eagle3", "LlamaForCausalLMEagle3", 1)
    assert d["target"] == {"name": None, "num_hidden_layers": 8, "hidden_size": 64,
                           "vocab_size": 512}  # fmt: skip
    assert d["target_layer_ids"] == [2, 4, 5] and d["target_layer_rule"].startswith("inputs of")
    assert [d[k] for k in VOCAB_FIELDS] == [
        len(ids), {"present": True, "target_ids": [min(ids), max(ids)], "distinct": True}, True
    ]
    assert d["tensor_count"] == 3 + 10 + 1 and d["dtypes"] == {"BF16": 13, "I64": 1}
    assert (d["shared_tensors_left_out"], d["norm_before_residual"]) == ([], False)
    assert result["problems"] == [] and result["pairing"]["problems"] == []
    out = CliRunner().invoke(app, ["inspect", str(draft)])
    assert out.exit_code == 0, out.output
    assert "target layers read  inputs of target layers 2, N // 2, N - 3 (EAGLE's default)" in out.stdout
    assert f"draft vocabulary    {len(ids)} tokens" in out.stdout
    assert f"d2t                 draft id + offset -> target ids {min(ids)}..{max(ids)}" in out.stdout
    assert "no problems found" in out.stdout


def test_inspect_reads_the_speculators_format(tmp_path: Path) -> None:
    """Its nested fields and `layers.0.*` names, the layer ids and target its config names,
    norm_before_residual true by default; the copy of the target's embedding left out."""
    target, draft = pair(tmp_path, "qwen3", text=4)
    d = inspect_checkpoint(str(draft))["drafter"]
    assert (d["target_layer_ids"], d["target_layer_rule"]) == ([1, 3, 5], "config")
    assert (d["architecture"], d["layers"]) == ("Eagle3Speculator", 1)
    assert d["target"] == {"name": "Qwen/Qwen3-8B", "num_hidden_layers": None,
                           "hidden_size": 64, "vocab_size": 512}  # fmt: skip
    assert d["shared_tensors_left_out"] == ["embed_tokens.weight"] and d["norm_before_residual"]
    assert d["tensor_count"] == 14
    out = CliRunner().invoke(app, ["inspect", str(draft)])
    lines = [line.rstrip() for line in out.stdout.splitlines()]
    assert "target layers read  inputs of 1, 3, 5" in lines


def test_inspect_names_another_target_and_a_broken_drafter(tmp_path: Path) -> None:
    from tests.checkpoints import build_dense_model

    target, draft = pair(tmp_path, "qwen3", text=4)
    other = build_dense_model(tmp_path / "other", "qwen3", layers=4)
    args = ["inspect", str(draft), "--target", str(other), "--require-mtp", "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 3
    (problem,) = json.loads(out.stdout)["problems"]
    assert problem["code"] == "another_target"
    assert problem["message"].endswith("it reads target layers [5], and this one has 4")
    wider = tmp_path / "wider"  # another target's hidden size and vocabulary: its config says
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "hidden_size": 128, "vocab_size": 1024, "num_hidden_layers": 6}))  # fmt: skip
    pairing = inspect_checkpoint(str(draft), target=str(wider))["pairing"]
    assert pairing["problems"] == [
        "it fuses hidden states of width 64, and this target's are 128 wide",
        "a vocabulary of 512 against the target's 1024",
    ]
    config = json.loads((draft / "config.json").read_text())
    config["transformer_layer_config"]["num_hidden_layers"] = 2
    (draft / "config.json").write_text(json.dumps(config))
    tensors = _tensors(draft)
    del tensors["layers.0.hidden_norm.weight"]
    tensors["d2t"] = tensors["d2t"] + 600
    _save(draft, tensors)
    problems = [(p["code"], p["message"]) for p in inspect_checkpoint(str(draft))["problems"]]
    shifted = np.arange(tensors["d2t"].size) + np.array(tensors["d2t"])
    low, high = int(shifted.min()), int(shifted.max())
    assert problems == [
        ("drafter_config", "it has 2 decoder layers; mtpkit runs the one-layer EAGLE-3 drafters "
                           "that are published"),  # fmt: skip
        ("drafter_tensors", "it lacks midlayer.hidden_norm.weight (1 tensor(s) missing)"),
        ("drafter_vocabulary", f"d2t maps draft ids to target ids [{low}, {high}], outside its "
                               "vocabulary of 512"),  # fmt: skip
    ]
    out = CliRunner().invoke(app, ["generate", "--model", str(target), "--draft-model",
                                   str(draft), "-p", "x", "-m", "4"])  # fmt: skip
    assert out.exit_code == 1
    assert out.output.count("\n") == 1 and "cannot draft" in out.output


def test_a_pytorch_bin_drafter_is_one_line(tmp_path: Path) -> None:
    """EAGLE's own uploads are `pytorch_model.bin`: named, with what mtpkit reads."""
    target, draft = pair(tmp_path, "llama", text=4)
    (draft / "model.safetensors").rename(draft / "pytorch_model.bin")
    problems = inspect_checkpoint(str(draft))["problems"]
    assert [p["code"] for p in problems] == ["no_weights"]
    assert "pytorch_model.bin only: mtpkit reads safetensors" in problems[0]["message"]
    out = CliRunner().invoke(app, ["generate", "--model", str(target), "--draft-model",
                                   str(draft), "-p", "x", "-m", "4"])  # fmt: skip
    assert out.exit_code == 1 and out.output.count("\n") == 1
    assert "it has pytorch_model.bin: mtpkit reads safetensors only" in out.output


def test_convert_keeps_the_drafts_and_leaves_the_targets_tensors(tmp_path: Path) -> None:
    """A speculators export carrying a copy of the target's embedding: converted, the copy
    is gone, the tensors are the same bf16 bytes in EAGLE's names (converting again changes
    nothing), and the converted drafter drafts exactly what the published one drafts."""
    target, draft = pair(tmp_path, "qwen3", text=4)
    out = convert(str(draft), output=tmp_path / "mlx")
    again = convert(str(out.output), output=tmp_path / "again")
    source = {k.replace("layers.0.", "midlayer."): v for k, v in _tensors(draft).items()}
    converted = _tensors(out.output)
    assert sorted(converted) == sorted(k for k in source if k != "embed_tokens.weight")
    assert all(mx.array_equal(converted[k], source[k]) for k in converted)
    assert converted["d2t"].dtype == mx.int64 and converted["t2d"].dtype == mx.bool_
    twice = _tensors(again.output)
    assert all(mx.array_equal(twice[k], converted[k]) for k in converted)
    runs = []
    for d in (draft, out.output):
        decoder = decoder_for(target, d, depth=3)
        seen = spy_drafts(decoder)
        runs.append((list(decoder.tokens(12)), seen))
    assert runs[0] == runs[1]


def test_a_quantized_drafter_stays_exact(tmp_path: Path) -> None:
    target, draft = pair(tmp_path, "llama", text=4)
    out = CliRunner().invoke(app, ["convert", str(draft), "-o", str(tmp_path / "q"), "-q",
                                   "--mtp-bits", "8", "--q-group-size", "32"])  # fmt: skip
    assert out.exit_code == 0, out.output
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    d = inspect_checkpoint(str(tmp_path / "q"))["drafter"]
    assert d["quantized"] and d["dtypes"]["U32"] == 9  # fc, q/k/v/o, the MLP, lm_head
    decoder = decoder_for(target, tmp_path / "q", depth=3)
    assert list(decoder.tokens(12)) == stock_tokens(target, PROMPT, 12, eos=False)
    assert decoder.stats.drafted > 0


def test_generate_and_bench_recognise_the_drafter(tmp_path: Path) -> None:
    target, draft = pair(tmp_path, "llama", text=4)
    args = ["generate", "--model", str(target), "-p", "x", "-m", "8", "--no-chat-template",
            "--draft-model", str(draft), "--depth", "3", "--no-adaptive"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert "Drafter: EAGLE-3 drafter, depth 3, acceptance" in out.stdout
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    assert '"drafter": "eagle3"' in out.stdout
    out = CliRunner().invoke(app, ["bench", "--model", str(target), "--draft-model", str(draft),
                                   "--trials", "1", "--max-tokens", "6", "--depth", "2",
                                   "--json"])  # fmt: skip
    assert out.exit_code == 0, out.output
    (run,) = json.loads(out.stdout)["adaptive"]  # mtpkit's row alone: stock cannot load it
    assert run["drafter"] == "eagle3" and run["rounds"] > 0


def test_the_python_api_takes_the_drafter(tmp_path: Path) -> None:
    """`mtpkit.load(..., draft_model=DIR)` drafts with it; the tokens are stock mlx-lm's."""
    import mtpkit

    target, draft = pair(tmp_path, "llama", text=4)
    engine = mtpkit.load(target, draft_model=draft)
    events = list(mtpkit.stream_generate(engine, PROMPT, max_tokens=10, depth=2))
    assert [e.token for e in events if e.token is not None] == stock_tokens(target, PROMPT, 10)
    assert engine.drafter_name == "eagle3"


def test_serve_drafts_with_it_in_a_batch(tmp_path: Path) -> None:
    """`serve --draft-model EAGLE3_DIR --decode-concurrency 2`: the batch takes it (no
    "decodes one at a time" line), the answer is stock mlx-lm's text and names the drafter."""
    import openai

    from tests.serve_process import ServerProcess
    from tests.test_serve import TIMEOUT, References

    target, draft = pair(tmp_path, "llama", text=4)
    refs = References(target)
    proc = ServerProcess(target, tmp_path / "server.log", "--draft-model", str(draft),
                         "--decode-concurrency", "2")  # fmt: skip
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=TIMEOUT)
        r = client.completions.create(model="default_model", prompt="x =", max_tokens=12)
    finally:
        proc.stop()
    text, count = refs.stock_text(refs.text_ids("x ="), 12)
    assert r.choices[0].text == text and r.usage.completion_tokens == count
    assert r.model_extra["mtp"]["drafter"] == "eagle3" and r.model_extra["mtp"]["drafted"] > 0
    log = (tmp_path / "server.log").read_text()
    assert "does not decode in a batch" not in log and "Traceback" not in log
