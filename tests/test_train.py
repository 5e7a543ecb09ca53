"""`mtpkit train-head`: a head trained by self-distillation must earn its place.

- The bundled trained example with its shipped head removed: the retrained head gets most of
  the shipped head's acceptance on held-out prompts (docstrings of modules the model never
  trained on, and check's prompts), measured by `measure_acceptance`, the greedy drafting
  loop `generate --mtp` runs; and `check` passes it.
- A tiny Llama written by stock mlx-lm (no head at all): after train-head, greedy MTP decoding
  is identical to stock mlx-lm's, and acceptance is reported.
- Resume continues bit for bit where a checkpoint left off; `--into` installs atomically and
  refuses to replace a head without `--force`; bad destinations and data are one-line errors.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.core.corpus import file_documents
from mtpkit.core.errors import MtpkitError
from mtpkit.speculative.generate import generate, load_model, measure_acceptance
from mtpkit.train.data import ChunkStream, DataSpec
from mtpkit.train.loop import TrainSettings, train_head
from tests.checkpoints import build_dense_model
from tests.conftest import EXAMPLE

runner = CliRunner()

# The example's retraining, shortened: `bench/bench_train.py` runs 500 steps.
EXAMPLE_ARGS = ["--steps", "150", "--batch-size", "8", "--seq-len", "64", "--lr", "3e-3"]
LLAMA_ARGS = ["--steps", "24", "--batch-size", "4", "--seq-len", "32", "--samples-per-prompt", "2"]
LLAMA_ARGS += ["--eval-every", "12", "--quiet"]


def heldout_prompts(n: int = 16) -> list[str]:
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    return [line[:60] for line in lines[-n:]]


def acceptance(model_dir: Path) -> tuple[float, float]:
    """(docstrings the model never saw, check's 32 prompts): greedy depth-1 acceptance. Neither
    set is among the prompts train-head generates its text from."""
    from mtpkit.core.prompts import BUILTIN_PROMPTS, RESERVE_PROMPTS

    docs = measure_acceptance(model_dir, heldout_prompts(), max_tokens=32, chat_template=False)
    probes = measure_acceptance(model_dir, [*BUILTIN_PROMPTS, *RESERVE_PROMPTS], max_tokens=48)
    return docs, probes


@pytest.fixture(scope="module")
def headless(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted example without its head (the state of many published conversions)."""
    out = tmp_path_factory.mktemp("headless") / "tiny"
    shutil.copytree(converted, out, ignore=shutil.ignore_patterns("mtp", "mtp.safetensors"))
    return out


@pytest.fixture(scope="module")
def retrained(headless: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("retrained") / "tiny-trained"
    result = runner.invoke(
        app, ["train-head", str(headless), "-o", str(out), *EXAMPLE_ARGS, "--json"]
    )
    assert result.exit_code == 0, result.output
    return out, json.loads(result.stdout)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with random weights, written by stock mlx-lm, no MTP head."""
    return build_dense_model(tmp_path_factory.mktemp("llama") / "tiny-llama", "llama")


def test_retrained_example_gets_most_of_the_shipped_acceptance(converted, retrained) -> None:
    out, summary = retrained
    shipped, trained = acceptance(converted), acceptance(out)
    print(f"acceptance (docstrings, check prompts): shipped {shipped}, retrained {trained}")
    # The target is >= the shipped head: bench/bench_train.py's 500 steps (about six
    # CPU minutes) reach it on both sets (README). These 150 steps (about two CPU minutes, kept
    # short for CI) fall short (49.8% / 63.5% on unconditioned text, 60.1% / 74.6% on prompted
    # samples before it); the bar here holds across the seeds and data tried.
    assert trained[1] >= 0.8 * shipped[1]
    assert trained[0] >= 0.5 * shipped[0]
    assert summary["heldout_acceptance"] > summary["heldout_acceptance_start"] + 0.3
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["peak_rss_bytes"] > 0 and summary["cpu_seconds"] > 0
    manifest = json.loads((out / "mtp" / "manifest.json").read_text())
    assert manifest["family"] == "qwen3_5" and manifest["rmsnorm_weight_format"] == "mlx_gamma"
    assert manifest["training"]["steps"] == 150
    assert manifest["training"]["settings"]["data"]["source"] == "self_generated"
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"]


def test_check_passes_the_retrained_head(retrained) -> None:
    from mtpkit.check.verdict import check_checkpoint

    out, _ = retrained
    result = check_checkpoint(str(out), max_tokens=24)
    failed = [c for c in result["checks"] if c["status"] == "fail"]
    assert result["verdict"] == "pass", failed


def test_llama_head_decodes_losslessly(llama, tmp_path) -> None:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    out = tmp_path / "llama-mtp"
    result = runner.invoke(app, ["train-head", str(llama), "-o", str(out), *LLAMA_ARGS, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["family"] == "llama" and summary["heldout_acceptance"] is not None
    assert out.stat().st_mode & 0o777 == 0o755  # as convert's (the tests run under umask 022)
    stored = mx.load(str(out / "mtp" / "weights.safetensors"))
    assert "mtp.fc.weight" in stored and "mtp.layers.0.self_attn.q_proj.weight" in stored

    model, tokenizer = load(str(llama))
    prompt = tokenizer.encode("The history of the printing press")
    stock = [t for t, _ in zip(generate_step(mx.array(prompt), model), range(40), strict=False)]
    stock = [int(t) for t, _ in stock]
    m = load_model(out)
    drafted = generate(m, prompt, max_tokens=40, depth=2, adaptive=False)
    assert drafted.tokens == stock
    assert drafted.drafted > 0 and drafted.acceptance is not None
    cli = runner.invoke(
        app, ["generate", "--model", str(out), "--mtp", "--prompt", "hello", "--max-tokens", "8"]
    )
    assert cli.exit_code == 0 and "MTP: depth 1-3 (rounds at each: " in cli.stdout, cli.output


class Interrupted(Exception):
    pass


def test_resume_continues_where_the_checkpoint_left_off(llama, tmp_path) -> None:
    settings = TrainSettings(
        steps=6,
        batch_size=2,
        seq_len=16,
        checkpoint_every=3,
        eval_every=3,
        data=DataSpec(samples_per_prompt=1),
    )
    whole = train_head(str(llama), settings=settings, checkpoint_dir=tmp_path / "a")

    def crash_after_3(step: int, loss: float | None, acc: float | None) -> None:
        if step == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        train_head(
            str(llama), settings=settings, checkpoint_dir=tmp_path / "b", on_step=crash_after_3
        )
    resumed = train_head(str(llama), settings=settings, checkpoint_dir=tmp_path / "b", resume=True)
    assert resumed.resumed_from == 3
    assert [h["step"] for h in resumed.history] == [h["step"] for h in whole.history]
    a = dict(tree_flatten(whole.head.parameters()))
    b = dict(tree_flatten(resumed.head.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.allclose(a[k], b[k], atol=1e-6).item(), k
    # A checkpoint made with other settings is refused.
    other = TrainSettings(**{**settings.__dict__, "seq_len": 32})
    with pytest.raises(MtpkitError, match="was made with seq_len=16, not 32"):
        train_head(str(llama), settings=other, checkpoint_dir=tmp_path / "b", resume=True)


def test_into_installs_atomically_and_refuses_a_head(llama, tmp_path) -> None:
    target = tmp_path / "conversion"
    shutil.copytree(llama, target)
    args = ["train-head", str(llama), "--into", str(target), *LLAMA_ARGS]
    args[args.index("24")] = "4"
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert (target / "mtp" / "weights.safetensors").exists()
    assert json.loads((target / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == []
    again = runner.invoke(app, args)
    assert again.exit_code == 1
    assert again.stderr.strip().splitlines() == [
        f"Error: --into {target} already has an MTP head: pass --force to replace it"
    ]
    forced = runner.invoke(app, [*args, "--force"])
    assert forced.exit_code == 0, forced.output
    assert load_model(target).head is not None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-o", "{tmp}"], "exists: pass --force to replace it"),
        (["-o", "{tmp}/new", "--data", "{tmp}/corpus.csv"], "must be .txt or .jsonl files"),
        (["-o", "{tmp}/new", "--data", "{tmp}/missing.txt"], "no such file"),
    ],
)
def test_bad_destinations_and_data_are_one_line_errors(llama, tmp_path, extra, message) -> None:
    (tmp_path / "corpus.csv").write_text("a,b\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    result = runner.invoke(app, ["train-head", str(llama), *args])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0]
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("extra", [[], ["-o", "{tmp}/a", "--into", "{tmp}/b"]])
def test_no_or_two_destinations_are_usage_errors(llama, tmp_path, extra) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    result = runner.invoke(app, ["train-head", str(llama), *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert (
        lines[0].startswith("Usage: ") and "pass -o DIR" in lines[-1] and "--into DIR" in lines[-1]
    )
    assert list(tmp_path.iterdir()) == []


def test_file_corpora_stream_in_chunks(llama, tmp_path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(llama)
    (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\nsecond one\n")
    rows = [
        {"text": "plain text"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"prompt": "question", "completion": " answer"},
    ]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    docs = list(file_documents(tokenizer, files))
    assert len(docs) == 5
    assert docs[0] == list(tokenizer.encode("first paragraph\nstill first"))
    assert docs[3] == list(
        tokenizer.apply_chat_template(rows[1]["messages"], add_generation_prompt=False)
    )
    stream = ChunkStream(length=8, seed=1, end=2, tokenizer=tokenizer, files=files, buffer=4)
    batches = [stream.next_batch(3).tolist() for _ in range(3)]
    again = ChunkStream(length=8, seed=1, end=2, tokenizer=tokenizer, files=files, buffer=4)
    again.skip(6)
    assert again.next_batch(3).tolist() == batches[2]
    assert all(len(row) == 8 for batch in batches for row in batch)


@pytest.mark.parametrize("where", ["parent", "itself", "inside"])
def test_an_output_overlapping_the_model_is_refused(llama, tmp_path, where) -> None:
    models = tmp_path / "models"
    model = Path(shutil.copytree(llama, models / "llama"))
    (models / "README.md").write_text("another model's notes\n")
    out = {"parent": models, "itself": model, "inside": model / "sub"}[where]
    before = {p: p.read_bytes() for p in models.rglob("*") if p.is_file()}
    result = runner.invoke(app, ["train-head", str(model), "-o", str(out), "--force"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: -o {out} ") and "source" in lines[0]
    assert {p: p.read_bytes() for p in models.rglob("*") if p.is_file()} == before


def test_a_model_with_its_head_in_the_shards_is_refused(checkpoint, tmp_path) -> None:
    raw = checkpoint("mimo")  # a raw checkpoint: the head lies in model-0000x shards
    result = runner.invoke(app, ["train-head", str(raw), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: MODEL {raw} keeps an MTP head in ")
    assert not (tmp_path / "out").exists()


def test_a_killed_checkpoint_write_leaves_the_previous_one(llama, tmp_path, monkeypatch) -> None:
    """A checkpoint is one unit: a kill in the middle of writing the next leaves the last
    complete one, and a damaged or mixed one is refused with one line."""
    from mtpkit.train import checkpoint as ckpt

    settings = TrainSettings(
        steps=4,
        batch_size=2,
        seq_len=16,
        checkpoint_every=2,
        eval_every=4,
        data=DataSpec(samples_per_prompt=1),
    )
    directory = tmp_path / "state"
    real_save = ckpt.mx.save_safetensors
    calls = []

    def killed_during_step_4(path: str, tensors, metadata=None) -> None:
        calls.append(path)
        if len(calls) == 4:  # step 4's optimizer file: the head's file is already written
            raise Interrupted
        real_save(path, tensors, metadata)

    monkeypatch.setattr(ckpt.mx, "save_safetensors", killed_during_step_4)
    with pytest.raises(Interrupted):
        train_head(str(llama), settings=settings, checkpoint_dir=directory)
    monkeypatch.setattr(ckpt.mx, "save_safetensors", real_save)
    assert json.loads((directory / "state.json").read_text())["step"] == 2
    resumed = train_head(str(llama), settings=settings, checkpoint_dir=directory, resume=True)
    assert resumed.resumed_from == 2
    # A mix of two steps (a file copied from another checkpoint) is refused, not trained on.
    (directory / "head-4.safetensors").rename(directory / "head-2.safetensors")
    state = json.loads((directory / "state.json").read_text())
    state.update(step=2, chunks=4, losses=state["losses"][:2])  # a state.json of step 2
    state["history"] = [h for h in state["history"] if h["step"] <= 2]
    (directory / "state.json").write_text(json.dumps(state))
    with pytest.raises(MtpkitError, match="is of step 4 but state.json names step 2"):
        train_head(str(llama), settings=settings, checkpoint_dir=directory, resume=True)
    (directory / "state.json").write_text('{"step": ')
    result = runner.invoke(
        app,
        [
            "train-head",
            str(llama),
            "-o",
            str(tmp_path / "o"),
            "--checkpoint-dir",
            str(directory),
            "--resume",
            *LLAMA_ARGS,
        ],
    )
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: --resume: {directory / 'state.json'} is damaged (JSONDecodeError): delete "
        f"{directory} and train from the start"
    ]


def test_a_head_trained_on_a_4bit_conversion_passes_check(checkpoint, tmp_path) -> None:
    """The old head's 4-bit entries leave config.json with it: check finds what it records."""
    quantized = tmp_path / "q4"
    ok = runner.invoke(
        app, ["convert", str(checkpoint("mimo")), "-o", str(quantized), "--bits", "4", "--quiet"]
    )
    assert ok.exit_code == 0, ok.output
    out = tmp_path / "trained"
    args = ["train-head", str(quantized), "-o", str(out), "--steps", "2", "--batch-size", "2"]
    args += ["--seq-len", "16", "--samples-per-prompt", "1", "--eval-every", "2", "--quiet"]
    trained = runner.invoke(app, args)
    assert trained.exit_code == 0, trained.output
    result = runner.invoke(app, ["check", str(out), "--no-probe", "--json"])
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}
    assert checks["quantization"] == "pass" and checks["head_present"] == "pass"


def test_a_killed_runs_copy_is_removed_by_the_next(llama, tmp_path) -> None:
    """The same stale-sibling rule as convert's: a model-sized hidden copy left by a killed
    train-head is removed, with a line saying so, by the next run writing there."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / f".out.mtpkit-tmp-{proc.pid}"
    (stale / "mtp").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half a model")
    out = tmp_path / "out"
    result = runner.invoke(app, ["train-head", str(llama), "-o", str(out), "--data", "nope.csv"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        f"removing {stale}, left by an earlier run that did not finish"
    )
    assert not stale.exists() and not out.exists()


def test_into_writes_nothing_through_a_link_leaving_the_model(llama, tmp_path) -> None:
    other = tmp_path / "other-model-mtp"
    other.mkdir()
    (other / "weights.safetensors").write_bytes(b"another model's head")
    target = Path(shutil.copytree(llama, tmp_path / "conversion"))
    (target / "mtp").symlink_to(other)
    result = runner.invoke(app, ["train-head", str(llama), "--into", str(target), *LLAMA_ARGS])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: --into {target}: mtp is a link to {other}, outside {target}; mtpkit writes "
        "nothing through it: replace the link with a directory"
    ]
    assert (other / "weights.safetensors").read_bytes() == b"another model's head"


@pytest.mark.parametrize("json_output", [False, True], ids=["table", "json"])
def test_progress_lines_in_a_log(llama, tmp_path, json_output) -> None:
    """stderr that is not a terminal (CliRunner's, a CI log) gets a line at each quarter of
    the text generation (a minute or more before the first step) and a line per held-out
    measurement, the start and the end included, so a long run shows it is alive; with
    --json too (the JSON goes to stdout, progress to stderr)."""
    args = [a for a in LLAMA_ARGS if a != "--quiet"] + (["--json"] if json_output else [])
    result = runner.invoke(app, ["train-head", str(llama), "-o", str(tmp_path / "o"), *args])
    assert result.exit_code == 0, result.output
    if json_output:
        assert json.loads(result.stdout)["steps"] == 24
    data = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("generating text to train on:")
    ]
    assert len(data) == 4, result.stderr
    pattern = r"generating text to train on: (\d+)/24 samples \(\d+s elapsed, about \d+s left\)"
    done = [int(re.fullmatch(pattern, text)[1]) for text in data]
    assert done == [6, 12, 18, 24], data  # the 24 prompts of the built-in set
    lines = [line for line in result.stderr.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and "\r" not in result.stderr, result.stderr
    assert re.fullmatch(r"step 0/24: held-out acceptance \d+\.\d%", lines[0]), lines
    for n, text in zip((12, 24), lines[1:], strict=True):
        pattern = rf"step {n}/24: loss \d+\.\d{{4}}, held-out acceptance \d+\.\d% "
        assert re.match(pattern + r"\(\d+s elapsed, about \d+s left\)$", text), text


def test_checkpoint_dir_keeps_what_train_head_did_not_write(llama, tmp_path) -> None:
    """`--checkpoint-dir` naming a directory of the user's (issue 33 item 1): after a run, only
    the files train-head wrote there are gone; a directory the run made is gone too."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.tex").write_text("\\documentclass{article}\n")
    (docs / "head-notes.txt").write_text("mine\n")
    for directory, out in ((docs, "a"), (tmp_path / "fresh", "b")):
        result = runner.invoke(
            app,
            [
                "train-head", str(llama), "-o", str(tmp_path / out),
                "--checkpoint-dir", str(directory), *LLAMA_ARGS,
            ],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
    assert sorted(p.name for p in docs.iterdir()) == ["head-notes.txt", "thesis.tex"]
    assert not (tmp_path / "fresh").exists()
def test_quiet_shows_no_progress(llama, tmp_path) -> None:
    """--quiet: neither the text generation nor the steps print anything (with --json
    stdout holds only the JSON)."""
    result = runner.invoke(
        app, ["train-head", str(llama), "-o", str(tmp_path / "o"), *LLAMA_ARGS, "--json"]
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert json.loads(result.stdout)["steps"] == 24


def test_a_base_models_generated_text_fills_every_chunk_of_the_run(converted) -> None:
    """The README's promise for self-generated text, "the run sees new text in every chunk":
    a base model's samples are kept past the end-of-text tokens it writes (the next
    document of its own stream), so the pool holds a run's worth of tokens. Cut at their
    first end-of-text token they kept about a sixth of that on the example, and a default
    run went over its pool six times."""
    from mtpkit.train.data import generate_pool

    m = load_model(converted, with_head=False)
    steps, batch, length = 4, 8, 32
    pool = generate_pool(
        m.model, m.tokenizer, DataSpec(), length=length, seed=0, chunks=steps * batch
    )
    assert sum(len(doc) for doc in pool) >= steps * batch * length


def test_the_cli_defaults_are_the_measured_ones() -> None:
    """`train-head`'s option defaults are TrainSettings's, the settings
    `bench/train_defaults.py` measured on the example (the CLI writes them out so that it
    imports no MLX before it runs)."""
    import inspect

    from mtpkit.cli.commands.train_head import train_head_command

    params = inspect.signature(train_head_command.__wrapped__).parameters
    settings = TrainSettings()
    for name in ("steps", "lr", "batch_size", "seq_len", "weight_decay", "grad_clip", "seed"):
        assert params[name].default == getattr(settings, name), name
