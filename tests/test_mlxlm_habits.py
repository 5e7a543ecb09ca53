"""mlx-lm users feel at home: mlx_lm.convert's and mlx_lm.generate's flags, meanings and output
habits, and the smaller traps an mlx-lm user met (issue 22).

References are independent of the code under test: stock mlx-lm (its tokenizer, its sampler
filters, `stream_generate`), numpy, or mtpkit's own long-standing spelling of the same request.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.convert import convert
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.decode import MtpDecoder
from mtpkit.speculative.generate import generate
from tests import hub_server
from tests.checkpoints import write_tokenizer
from tests.injected import inject_drafts

hub = hub_server.hub
runner = CliRunner()
PROMPT = "Return a new list of the"
COMMANDS = ("inspect", "check", "convert", "generate", "bench", "train-head")


@pytest.fixture(scope="module")
def mimo(checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted MiMo (dense, its own random head; mlx-lm gives it plain KV caches)."""
    out = tmp_path_factory.mktemp("mimo") / "mimo-mlx"
    return convert(str(checkpoint("mimo", dtype="float32")), output=out).output


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama written by stock mlx-lm: a dense family that ships no MTP head."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    path = tmp_path_factory.mktemp("llama") / "tiny-llama"
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 512,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    }
    mx.random.seed(3)
    save_model(path, llama.Model(llama.ModelArgs.from_dict(config)))
    save_config(config, path / "config.json")
    write_tokenizer(path, vocab_size=512)
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- convert


def test_convert_takes_mlx_lm_converts_command_line(checkpoint, tmp_path: Path) -> None:
    """`mlx_lm.convert --hf-path S --mlx-path O -q` means what it means there: 4-bit, group 64."""
    src = checkpoint("mimo", dtype="float32")
    mine = tmp_path / "mlx-lm-style"
    args = ["convert", "--hf-path", str(src), "--mlx-path", str(mine), "-q", "--quiet"]
    result = runner.invoke(app, [*args, "--trust-remote-code"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "note: mtpkit never runs a checkpoint's own code; --trust-remote-code changes nothing "
        "(every supported family is built from mlx-lm's classes)"
    ]
    old = tmp_path / "mtpkit-style"
    legacy = ["convert", str(src), "-o", str(old), "--bits", "4", "--group-size", "64"]
    assert runner.invoke(app, [*legacy, "--quiet"]).exit_code == 0
    a, b = _files(mine), _files(old)
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if k != "mtp/manifest.json")
    quant = json.loads((mine / "config.json").read_text())["quantization"]
    assert {k: quant[k] for k in ("group_size", "bits", "mode")} == {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
    }


def test_keep_mtp_bf16_without_quantization_warns(checkpoint, tmp_path: Path) -> None:
    src = checkpoint("mimo", dtype="float32")
    args = ["convert", str(src), "-o", str(tmp_path / "o"), "--keep-mtp-bf16", "--quiet"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("Warning: nothing is quantized without -q")


# --------------------------------------------------------------------------- every command


@pytest.mark.parametrize("command", COMMANDS)
def test_dash_h_is_help(command: str) -> None:
    result = runner.invoke(app, [command, "-h"])
    assert result.exit_code == 0 and result.stdout.startswith("Usage: ")
    for leaked in ("<list[", "{source}", "{model}", "<int range>", "<float range>", "<path>"):
        assert leaked not in result.stdout, leaked


def test_model_option_and_one_part_repo_ids(hub, checkpoint, mimo: Path) -> None:
    """--model wherever mlx-lm takes it; a one-part id is a Hub repo, as in huggingface_hub."""
    inspected = runner.invoke(app, ["inspect", "--model", str(mimo), "--json"])
    assert inspected.exit_code == 0 and json.loads(inspected.stdout)["family"] == "mimo"
    checked = runner.invoke(app, ["check", "--model", str(mimo), "--no-probe", "--json"])
    assert checked.exit_code == 0, checked.output
    hub.add_repo("tinymimo", checkpoint("mimo", dtype="float32"))
    remote = runner.invoke(app, ["inspect", "tinymimo", "--json"])
    assert remote.exit_code == 0, remote.output
    assert json.loads(remote.stdout)["source"] == "tinymimo"
    missing = runner.invoke(app, ["inspect", "--json"])
    assert missing.exit_code == 2 and "Missing argument 'SOURCE'" in missing.stderr


def test_json_errors_print_an_error_object(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["inspect", str(tmp_path / "empty"), "--json"])
    assert result.exit_code == 1
    error = result.stderr.strip().removeprefix("Error: ")
    assert json.loads(result.stdout) == {"error": error, "exit_code": 1}


# --------------------------------------------------------------------------- generate


def test_generate_takes_mlx_lm_generates_options(converted: Path) -> None:
    _, tokenizer = mlx_lm.load(str(converted))
    base = ["generate", "--model", str(converted), "--json"]

    def run(*args: str) -> dict:
        result = runner.invoke(app, [*base, *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    assert run("-p", PROMPT, "-m", "3")["generated_tokens"] <= 3
    raw = run("-p", PROMPT, "--ignore-chat-template", "-m", "1")
    assert raw["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    # --system-prompt and --prefill-response build mlx_lm.generate's messages.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    messages.append({"role": "assistant", "content": "def"})
    if tokenizer.chat_template:
        want = tokenizer.apply_chat_template(messages, continue_final_message=True)
        args = ("--system-prompt", "Be brief.", "--prefill-response", "def", "-m", "1")
        assert run("-p", PROMPT, *args)["prompt_tokens"] == len(want)
    # --extra-eos-token: generation stops before the first such token.
    code = "def read_config(path):"  # the example continues it past 12 tokens
    reference = run("-p", code, "-m", "12", "--no-mtp")["tokens"]
    stop = reference[6]
    stopped = run("-p", code, "-m", "12", "--extra-eos-token", str(stop), "--mtp")["tokens"]
    assert stopped == reference[: reference.index(stop)]
    # The default prompt is mlx_lm.generate's ("hello").
    assert run("-m", "1")["prompt_tokens"] == run("-p", "hello", "-m", "1")["prompt_tokens"]


def test_one_token_has_no_decode_rate(converted: Path) -> None:
    """The first token's time is the prompt's (mlx-lm's convention): one token has no decode
    rate, reported as null / n/a rather than 0.0 tok/s."""
    args = ["generate", "--model", str(converted), "-p", PROMPT, "-m", "1", "--no-mtp"]
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert data["generated_tokens"] == 1 and data["decode_tps"] is None
    text = runner.invoke(app, args).stdout
    assert "Generation: 1 tokens, n/a tokens-per-sec\n" in text


def test_min_p_filters_as_mlx_lm_does() -> None:
    """SamplingSettings' distribution (used for exact rejection sampling) against numpy."""
    logits = mx.array(np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 3)
    got = np.array(SamplingSettings(temp=0.7, min_p=0.1).probs(logits))
    x = np.array(logits, dtype=np.float64)
    logprobs = x - np.log(np.exp(x).sum(-1, keepdims=True))
    keep = logprobs >= logprobs.max(-1, keepdims=True) + math.log(0.1)
    z = np.where(keep, np.exp(logprobs / 0.7), 0.0)
    np.testing.assert_allclose(got, z / z.sum(-1, keepdims=True), atol=1e-5)
    assert (got[~keep] == 0).all()


def test_max_kv_size_decodes_as_stock_mlx_lm(mimo: Path) -> None:
    """Rotating caches of --max-kv-size: MTP decoding (a random head, so rejections and
    rollbacks every round) gives stock mlx-lm's tokens with the same bound."""
    m = load_model(mimo)
    prompt = m.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 2)
    stock_model, tokenizer = mlx_lm.load(str(mimo))
    reference = []
    for r in mlx_lm.stream_generate(
        stock_model, tokenizer, mx.array(prompt), max_tokens=40, max_kv_size=12
    ):
        if r.finish_reason == "stop":
            break
        reference.append(r.token)
    assert len(prompt) + len(reference) > 2 * 12  # the window wraps
    for depth, mtp in ((2, True), (1, False)):
        got = generate(
            m, prompt, max_tokens=40, depth=depth, mtp=mtp, max_kv_size=12, adaptive=False
        )
        assert got.tokens == reference, (depth, mtp)


def test_accepted_eos_draft_is_not_counted(converted: Path) -> None:
    """Drafts equal to the output, EOS included: the EOS draft (and any after it) count as
    neither drafted nor accepted, since no token came of them."""
    m = load_model(converted)
    prompt = encode_prompt(m.tokenizer, PROMPT)
    plain = generate(m, prompt, max_tokens=40, mtp=False)
    eos = next(iter(m.tokenizer.eos_token_ids))
    assert len(plain.tokens) < 40  # this prompt ends with EOS
    decoder = MtpDecoder(m, prompt, depth=3, sampling=SamplingSettings(), adaptive=False)
    inject_drafts(decoder, [*plain.tokens, eos], [3] * 40, m.embedding.weight.shape[0])
    tokens = list(decoder.tokens(40))
    assert tokens == plain.tokens
    assert decoder.stats.accepted <= len(tokens)
    assert decoder.stats.drafted == decoder.stats.accepted  # every counted draft was right


def test_dense_model_without_head_advises_train_head(llama: Path) -> None:
    result = runner.invoke(app, ["generate", "--model", str(llama), "-p", "hi", "-m", "2"])
    assert result.exit_code == 0, result.output
    assert f"train one with `mtpkit train-head {llama} -o OUT`" in result.stderr
    assert "mtpkit convert" not in result.stderr


# --------------------------------------------------------------------------- bench, train-head


def test_bench_usage_errors_and_device_name(converted: Path) -> None:
    from mtpkit.bench.speed import device_name

    for args, message in (
        (["--model", str(converted), "--dtype", "bfloat16"], "--dtype applies to the model"),
        (["--random", "qwen3_5-0.8b", "--random-layers", "6"], "multiple of 4"),
        ([], "pass --model SOURCE or --random SHAPE"),
    ):
        result = runner.invoke(app, ["bench", *args])
        assert result.exit_code == 2 and message in result.stderr.splitlines()[-1], result.output
    assert device_name() in ("cpu", "gpu")


def test_random_model_build_says_its_stages(tmp_path: Path, capsys) -> None:
    from mtpkit.bench.shapes import build_random_model

    lines: list[str] = []
    small = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 64, "vocab_size": 256}
    build_random_model("qwen3_5-0.8b", tmp_path / "m", overrides=small, progress=lines.append)
    assert [line.split(" ")[0] for line in lines] == ["building", "quantizing", "writing"]
    assert "4 layers" in lines[0]
    assert capsys.readouterr().out == ""  # mlx-lm's [INFO] line kept off stdout (--json)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_train_bar_eta_starts_at_the_first_step(monkeypatch) -> None:
    """On a terminal the bar is made at the first optimizer step, so its rate and ETA leave
    out data generation and the first held-out measurement."""
    from huggingface_hub.utils import are_progress_bars_disabled

    from mtpkit.train.progress import TrainProgress

    monkeypatch.setattr(sys, "stderr", Terminal())
    progress = TrainProgress(10, quiet=False, log=lambda s: None)
    progress(0, None, 0.25)
    assert progress.bar is None
    progress(1, 2.0, None)
    if not are_progress_bars_disabled():
        assert progress.bar is not None and progress.bar.n == 1
    progress.close()


def test_head_of_another_width_fails_check_at_once(converted, checkpoint, tmp_path) -> None:
    """A 64-wide head on the 128-wide example: head_complete fails from the headers (the
    probes are skipped, nothing is loaded to find out), generate says so in one line."""
    narrow = convert(str(checkpoint("qwen3_5")), output=tmp_path / "narrow").output
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad, ignore=shutil.ignore_patterns("mtp", "mtp.safetensors"))
    shutil.copytree(narrow / "mtp", bad / "mtp")
    result = runner.invoke(app, ["check", str(bad), "--json"])
    assert result.exit_code == 3
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["head_complete"]["status"] == "fail"
    assert "has shape [64], the config implies [128]" in checks["head_complete"]["detail"]
    assert checks["acceptance"]["status"] == "skip"
    gen = runner.invoke(app, ["generate", "--model", str(bad), "--mtp", "-m", "2"])
    assert gen.exit_code == 1 and gen.stderr.startswith("Error: the MTP head in ")
    assert "unexpected" not in gen.stderr and len(gen.stderr.splitlines()) == 1
