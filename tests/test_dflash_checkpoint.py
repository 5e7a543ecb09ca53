"""`mtpkit inspect`, `mtpkit convert` and `generate --draft-model` on DFlash drafters in
z-lab's published format (`tests/dflash_checkpoints.py`): what inspect reports is what the
config and tensors written say; a converted drafter drafts what the published one drafts
(bf16), and its quantized form stays exact (stock greedy tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from typer.testing import CliRunner

from mtpkit.checkpoint.report import inspect_checkpoint
from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from tests.checkpoints import build_dense_model
from tests.dflash_checkpoints import build_dflash
from tests.stock import stock_tokens
from tests.test_dflash import LAYERS, PROMPT, decoder_for, spy_drafts


def _pair(tmp: Path, **kwargs) -> tuple[Path, Path]:
    target = build_dense_model(tmp / "target", "qwen3", layers=4)
    return target, build_dflash(tmp / "dflash", target, target_layer_ids=LAYERS, **kwargs)


def test_inspect_names_what_the_drafter_reads(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path, block_size=16, mask_token_id=300)
    result = inspect_checkpoint(str(draft), target=str(target))
    d = result["drafter"]
    assert (d["kind"], d["architecture"], d["layers"]) == ("dflash", "DFlashDraftModel", 2)
    assert d["target"] == {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 512}
    assert d["target_layer_ids"] == LAYERS
    assert (d["block_size"], d["max_drafts"], d["mask_token_id"]) == (16, 15, 300)
    assert d["tensor_count"] == 3 + 2 * 11 and d["dtypes"] == {"BF16": 25}
    assert result["problems"] == [] and result["pairing"]["problems"] == []
    out = CliRunner().invoke(app, ["inspect", str(draft)])
    assert out.exit_code == 0, out.output
    assert "target layers read  0, 2" in out.stdout
    assert "block size          16 (up to 15 drafts a pass)" in out.stdout
    assert "no problems found" in out.stdout


def test_inspect_names_another_target_and_a_broken_drafter(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    other = build_dense_model(tmp_path / "other", "qwen3", layers=6)
    args = ["inspect", str(draft), "--target", str(other), "--require-mtp", "--json"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 3
    (problem,) = json.loads(out.stdout)["problems"]
    assert problem["code"] == "another_target"
    assert problem["message"].endswith("it reads a target of 4 layers, and this one has 6")
    config = json.loads((draft / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 900
    config["dflash_config"]["target_layer_ids"] = [0, 7]
    (draft / "config.json").write_text(json.dumps(config))
    tensors = mx.load(str(draft / "model.safetensors"))
    del tensors["layers.0.self_attn.k_norm.weight"]
    mx.save_safetensors(str(draft / "model.safetensors"), tensors, metadata={"format": "pt"})
    problems = [(p["code"], p["message"]) for p in inspect_checkpoint(str(draft))["problems"]]
    assert problems == [
        ("drafter_config", "mask_token_id 900 is outside its vocabulary of 512"),
        ("drafter_config", "target_layer_ids [7] are outside the 4 target layers"),
        ("drafter_tensors", "it lacks layers.0.self_attn.k_norm.weight (1 tensor(s) missing)"),
    ]
    out = CliRunner().invoke(app, ["generate", "--model", str(target), "--draft-model",
                                   str(draft), "-p", "x", "-m", "4"])  # fmt: skip
    assert out.exit_code == 1
    assert out.output.count("\n") == 1 and "cannot draft" in out.output


def test_an_eagle3_config_without_its_fields_is_one_line(tmp_path: Path) -> None:
    """Recognised as EAGLE-3 (read now: tests/test_eagle3_checkpoint.py), not as DFlash."""
    draft = tmp_path / "eagle3"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
         "draft_vocab_size": 32000, "hidden_size": 64}))  # fmt: skip
    mx.save_safetensors(str(draft / "model.safetensors"), {"d2t": mx.zeros((4,), mx.int32)})
    out = CliRunner().invoke(app, ["inspect", str(draft)])
    assert out.exit_code == 1
    assert "lacks 'num_attention_heads', which an EAGLE-3 drafter's config has" in out.output
    assert out.output.count("\n") == 1


def test_convert_keeps_the_drafts_and_leaves_the_targets_tensors(tmp_path: Path) -> None:
    """A published drafter carrying a copy of the target's embedding: converted, the copy
    is gone, the tensors are the same bf16 bytes (converting again changes nothing), and
    the converted drafter drafts exactly what the published one drafts."""
    target, draft = _pair(tmp_path, extra={"embed_tokens.weight": mx.zeros((512, 64), mx.bfloat16)})
    assert inspect_checkpoint(str(draft))["drafter"]["shared_tensors_left_out"] == [
        "embed_tokens.weight"
    ]
    out = convert(str(draft), output=tmp_path / "mlx")
    again = convert(str(out.output), output=tmp_path / "again")
    source = mx.load(str(draft / "model.safetensors"))
    converted = mx.load(str(out.output / "model.safetensors"))
    assert sorted(converted) == sorted(k for k in source if k != "embed_tokens.weight")
    assert all(mx.array_equal(converted[k], source[k]) for k in converted)
    twice = mx.load(str(again.output / "model.safetensors"))
    assert all(mx.array_equal(twice[k], converted[k]) for k in converted)
    runs = []
    for d in (draft, out.output):
        decoder = decoder_for(target, d, depth=4)
        seen = spy_drafts(decoder)
        runs.append((list(decoder.tokens(16)), seen))
    assert runs[0] == runs[1]


def test_a_quantized_drafter_stays_exact(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    out = CliRunner().invoke(app, ["convert", str(draft), "-o", str(tmp_path / "q"), "-q",
                                   "--mtp-bits", "8", "--q-group-size", "32"])  # fmt: skip
    assert out.exit_code == 0, out.output
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert inspect_checkpoint(str(tmp_path / "q"))["drafter"]["quantized"]
    decoder = decoder_for(target, tmp_path / "q", depth=3)
    assert list(decoder.tokens(16)) == stock_tokens(target, PROMPT, 16, eos=False)
    assert decoder.stats.drafted > 0


def test_generate_recognises_the_drafter(tmp_path: Path) -> None:
    target, draft = _pair(tmp_path)
    args = ["generate", "--model", str(target), "-p", "x", "-m", "8", "--no-chat-template",
            "--draft-model", str(draft), "--depth", "3", "--no-adaptive"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    assert "Drafter: DFlash block drafter, depth 3, acceptance" in out.stdout
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    assert '"drafter": "dflash"' in out.stdout
