"""`mtpkit train-head` under careless input: no non-finite head is ever written or installed,
a resume trusts nothing in `state.json`, and what the run cannot write is refused before the
training (issue 33, 6, 14 and 18)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.train.data import DataSpec
from mtpkit.train.loop import TrainSettings, train_head
from tests.checkpoints import build_dense_model

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
TEXT = "\n\n".join(f"def f{i}(x):\n    return x * {i} + {i * 7} - len(str(x))" for i in range(40))


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def one_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: ")
    return line


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dense_model(tmp_path_factory.mktemp("llama") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(TEXT)
    return path


def quick(corpus: Path, steps: int = 3) -> list[str]:
    return [
        "--steps", str(steps), "--batch-size", "2", "--seq-len", "16", "--data", str(corpus),
        "--quiet",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def with_head(llama, corpus, tmp_path_factory) -> Path:
    """The Llama with a working head installed by train-head."""
    target = tmp_path_factory.mktemp("head") / "model"
    shutil.copytree(llama, target)
    result = runner.invoke(app, ["train-head", str(llama), "--into", str(target), *quick(corpus)])
    assert result.exit_code == 0, result.output
    return target


def test_a_diverging_run_replaces_no_head(llama, corpus, with_head):
    """`--lr 1e30 --into DIR --force`: the loss turns NaN, the run stops there, and DIR keeps
    its working head (before: an all-NaN head was installed, exit 0)."""
    before = tree_hash(with_head)
    args = ["train-head", str(llama), "--into", str(with_head), "--force", "--lr", "1e30"]
    line = one_error(runner.invoke(app, [*args, *quick(corpus, steps=4)]))
    assert line.startswith("Error: training diverged at step ")
    assert line.endswith("nothing was written: train again with a lower --lr (this run: 1e+30)")
    assert tree_hash(with_head) == before


def test_a_non_finite_head_is_never_written(llama, with_head, tmp_path):
    """The last guard, whatever produced the head: write_trained_head refuses NaN."""
    from mtpkit.core.errors import MtpkitError
    from mtpkit.runtime.model import load_model
    from mtpkit.train.output import write_trained_head

    head = load_model(with_head).head
    head.update(_nan_like(head.parameters()))
    before = tree_hash(with_head)
    with pytest.raises(MtpkitError, match="holds NaN or Inf .*keeps its head"):
        write_trained_head(llama, head, into=with_head, force=True, hidden="post_norm", training={})
    assert tree_hash(with_head) == before
    with pytest.raises(MtpkitError, match="nothing was written"):
        write_trained_head(llama, head, output=tmp_path / "o", hidden="post_norm", training={})
    assert not (tmp_path / "o").exists()


def _nan_like(tree):
    if isinstance(tree, dict):
        return {k: _nan_like(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_nan_like(v) for v in tree]
    return mx.full(tree.shape, float("nan"), dtype=tree.dtype)


@pytest.fixture(scope="module")
def checkpoint_dir(llama, corpus, tmp_path_factory) -> Path:
    """A genuine checkpoint of step 2 of a 4-step run (train_head leaves its checkpoints)."""
    directory = tmp_path_factory.mktemp("ckpt") / "state"
    settings = TrainSettings(
        steps=2, batch_size=2, seq_len=16, checkpoint_every=2, data=DataSpec(files=(str(corpus),))
    )
    train_head(str(llama), settings=settings, checkpoint_dir=directory)
    return directory


def resume_args(llama, corpus, directory: Path, out: Path) -> list[str]:
    return [
        "train-head", str(llama), "-o", str(out), "--resume", "--checkpoint-dir", str(directory),
        *quick(corpus, steps=4),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "fault"),
    [
        ({"chunks": 10**12}, "chunks 1000000000000 is not step x batch_size (2 x 2)"),
        ({"chunks": -5}, "chunks -5 is not step x batch_size (2 x 2)"),
        (
            {"history": 5},
            "history is not a list of {step, loss, heldout_acceptance} of earlier steps",
        ),
        ({"losses": ["x", 1]}, "a loss is not a finite number"),
        ({"losses": [1.0]}, "losses is not a list of 2 numbers"),
        ({"step": 0}, "step 0 is not a positive whole number"),
    ],
)
def test_a_resume_validates_state_json(llama, corpus, checkpoint_dir, tmp_path, edit, fault):
    """Each fault is named before anything is trained or written; before, chunks 10**12 hung,
    -5 was accepted and the others ended in `unexpected` errors after writing the output."""
    directory = Path(shutil.copytree(checkpoint_dir, tmp_path / "state"))
    state = json.loads((directory / "state.json").read_text())
    (directory / "state.json").write_text(json.dumps({**state, **edit}))
    out = tmp_path / "out"
    line = one_error(runner.invoke(app, resume_args(llama, corpus, directory, out)))
    assert line == (
        f"Error: --resume: {directory / 'state.json'} is damaged ({fault}): delete "
        f"{directory} and train from the start"
    )
    assert not out.exists()


def test_a_resume_from_a_nan_checkpoint_is_refused(llama, corpus, checkpoint_dir, tmp_path):
    directory = Path(shutil.copytree(checkpoint_dir, tmp_path / "state"))
    head_file = directory / "head-2.safetensors"
    tensors, metadata = mx.load(str(head_file), return_metadata=True)
    name = sorted(tensors)[0]
    tensors[name] = mx.full(tensors[name].shape, float("nan"), dtype=tensors[name].dtype)
    mx.save_safetensors(str(head_file), tensors, metadata)
    out = tmp_path / "out"
    line = one_error(runner.invoke(app, resume_args(llama, corpus, directory, out)))
    assert line == (
        f"Error: --resume: the checkpoint in {directory} holds NaN or Inf ({name}): delete "
        f"{directory} and train from the start"
    )
    assert not out.exists()


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(llama, corpus, tmp_path):
    """Before: `unexpected` error after the whole training ran (issue 33, 18)."""
    blocker = tmp_path / "afile"
    blocker.write_text("mine\n")
    args = ["train-head", str(llama), "-o", str(tmp_path / "o"), "--checkpoint-dir", str(blocker)]
    line = one_error(runner.invoke(app, [*args, *quick(corpus)]))
    assert line == (
        f"Error: --checkpoint-dir {blocker}: {blocker} is a file, not a directory: choose "
        "another place"
    )
    assert blocker.read_text() == "mine\n" and not (tmp_path / "o").exists()


def test_an_output_that_cannot_be_written_is_refused_before_training(llama, corpus, tmp_path):
    """`-o` where nothing can be created (here under a file; a read-only directory is
    probed the same way, by creating a file) fails before the data generation and training."""
    blocker = tmp_path / "afile"
    blocker.write_text("mine\n")
    out = blocker / "out"
    line = one_error(runner.invoke(app, ["train-head", str(llama), "-o", str(out), *quick(corpus)]))
    assert line == f"Error: -o {out}: {blocker} is a file, not a directory: choose another place"


def test_a_full_disk_leaves_no_temporary_checkpoint_file(llama, corpus, tmp_path):
    """`ulimit -f` makes every write past 16 KiB fail, as a full disk does: one line, and no
    `.head-N.tmp.safetensors` left behind (before: left, with an `unexpected` error)."""
    checkpoints = tmp_path / "ck"
    out = tmp_path / "out"
    command = " ".join(
        f'"{a}"'
        for a in [sys.executable, "-m", "mtpkit", "train-head", llama, "-o", out,
                  "--checkpoint-dir", checkpoints, *quick(corpus, steps=2)]
    )  # fmt: skip
    proc = subprocess.run(
        ["sh", "-c", f"ulimit -f 16; exec {command}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"Error: writing the checkpoint of step 2 into {checkpoints} failed (")
    assert line.endswith(
        "the previous checkpoint is kept: free some space, or pass another --checkpoint-dir"
    )
    assert list(checkpoints.iterdir()) == []
    assert not out.exists()
