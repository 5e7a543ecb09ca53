"""Output safety of convert and graft: the source is never touched, leftovers are cleaned up."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.convert.destination import pid_alive, stale_siblings, temp_sibling

runner = CliRunner()


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file and link under `root` (and its siblings when asked), with a content hash."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def models(checkpoint, tmp_path) -> Path:
    """`models/` holding a raw checkpoint and a sibling file, as a user's folder does."""
    root = tmp_path / "models"
    root.mkdir()
    shutil.copytree(checkpoint("mimo"), root / "tiny-mimo")
    (root / "notes.txt").write_text("keep me\n")
    return root


@pytest.mark.parametrize("where", ["ancestor", "itself", "inside", "link_to_ancestor"])
@pytest.mark.parametrize("force", [False, True])
def test_output_overlapping_the_source_is_refused(models, tmp_path, where, force):
    src = models / "tiny-mimo"
    (tmp_path / "link").symlink_to(models)
    out = {
        "ancestor": models,
        "itself": src,
        "inside": src / "mlx",
        "link_to_ancestor": tmp_path / "link",
    }[where]
    before = tree_hashes(tmp_path)
    args = ["convert", str(src), "-o", str(out)] + (["--force"] if force else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: -o ")
    assert "source" in result.stderr
    assert tree_hashes(tmp_path) == before


def test_graft_into_the_source_is_refused(models):
    src = models / "tiny-mimo"
    before = tree_hashes(models)
    result = runner.invoke(app, ["convert", str(src), "--mtp-only", "--into", str(src), "--force"])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: --into ") and "source itself" in result.stderr
    assert tree_hashes(models) == before


def test_graft_refuses_an_existing_head_without_force(checkpoint, tmp_path):
    src = checkpoint("mimo")
    into = tmp_path / "mlx"
    assert runner.invoke(app, ["convert", str(src), "-o", str(into), "--quiet"]).exit_code == 0
    before = tree_hashes(into)
    result = runner.invoke(app, ["convert", str(src), "--mtp-only", "--into", str(into)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: --into {into} already has an MTP head (")
    assert result.stderr.rstrip().endswith("pass --force to replace it")
    assert tree_hashes(into) == before
    forced = ["convert", str(src), "--mtp-only", "--into", str(into), "--force", "--quiet"]
    assert runner.invoke(app, forced).exit_code == 0
    after = tree_hashes(into)
    assert after.keys() == before.keys()
    assert after["mtp/weights.safetensors"] == before["mtp/weights.safetensors"]  # same head


def test_stale_temp_siblings_of_dead_runs_are_removed(checkpoint, tmp_path):
    src = checkpoint("mimo")
    out = tmp_path / "out"
    assert runner.invoke(app, ["convert", str(src), "-o", str(out), "--quiet"]).exit_code == 0
    dead, live = dead_pid(), os.getppid()
    stale = tmp_path / f".out.mtpkit-tmp-{dead}"
    (stale / "mtp").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    old = tmp_path / f".out.mtpkit-old-{dead}"  # killed after its new output was in place
    old.mkdir()
    running = tmp_path / f".out.mtpkit-tmp-{live}"
    running.mkdir()
    other = tmp_path / f".other.mtpkit-tmp-{dead}"
    other.mkdir()
    assert stale_siblings([out]) == [old, stale]
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--quiet", "--force"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        f"removing {old}, left by an earlier run that did not finish",
        f"removing {stale}, left by an earlier run that did not finish",
    ]
    assert not stale.exists() and not old.exists()
    assert running.exists() and other.exists()  # a live run's, and another output's


def test_an_old_output_is_kept_until_a_new_one_is_in_place(checkpoint, tmp_path):
    """A run killed between its two final renames left the old output aside: the next run
    puts it back first, and a next run that fails leaves it in place."""
    src = checkpoint("mimo")
    out = tmp_path / "out"
    assert runner.invoke(app, ["convert", str(src), "-o", str(out), "--quiet"]).exit_code == 0
    before = tree_hashes(out)
    aside = tmp_path / f".out.mtpkit-old-{dead_pid()}"
    out.rename(aside)
    broken = Path(shutil.copytree(src, tmp_path / "broken"))
    (broken / "config.json").write_text("{")
    result = runner.invoke(app, ["convert", str(broken), "-o", str(out), "--force"])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == (
        f"restoring {out} from {aside}, left by a run killed while replacing it"
    )
    assert result.stderr.splitlines()[-1].startswith("Error: ")
    assert tree_hashes(out) == before and not aside.exists()


@pytest.fixture
def hf_cache(checkpoint, tmp_path) -> Path:
    """A Hugging Face cache entry: `snapshots/<sha>/*` are links into `blobs/`."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(checkpoint("mimo").iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    return repo


@pytest.mark.parametrize("force", [False, True])
def test_an_output_holding_the_sources_linked_files_is_refused(hf_cache, force):
    before = tree_hashes(hf_cache)
    snapshot, blobs = hf_cache / "snapshots" / "0123abcd", hf_cache / "blobs"
    for out in (blobs, hf_cache / "snapshots"):
        args = ["convert", str(snapshot), "-o", str(out)] + (["--force"] if force else [])
        result = runner.invoke(app, args)
        assert result.exit_code == 1, result.output
        assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"Error: -o {out} ")
        assert "source" in result.stderr
    assert tree_hashes(hf_cache) == before


def test_graft_writes_nothing_through_a_link_leaving_the_model(checkpoint, tmp_path):
    other = Path(shutil.copytree(checkpoint("mlx_plain", dtype="bfloat16"), tmp_path / "other"))
    (other / "mtp").mkdir()
    trunk = Path(shutil.copytree(checkpoint("mlx_plain", dtype="bfloat16"), tmp_path / "trunk"))
    (trunk / "mtp").symlink_to(other / "mtp")
    before = tree_hashes(tmp_path)
    args = ["convert", str(checkpoint("qwen3_5")), "--mtp-only", "--into", str(trunk), "--force"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: --into {trunk}: mtp is a link to {other / 'mtp'}, outside {trunk}; mtpkit "
        "writes nothing through it: replace the link with a directory"
    ]
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("what", ["photos", "file", "models", "cwd_like"])
def test_force_replaces_only_model_directories(checkpoint, tmp_path, what):
    src = checkpoint("mimo")
    out = tmp_path / what
    if what == "file":
        out.write_text("a thesis\n")
    else:
        out.mkdir()
        (out / "holiday.jpg").write_bytes(b"\xff\xd8")
        if what == "models":
            shutil.copytree(src, out / "tiny-mimo")
        if what == "cwd_like":
            (out / "config.json").write_text("{}")  # a project folder with a config file
    before = tree_hashes(tmp_path)
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--force"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: -o {out} --force: ")
    assert "--force replaces only a model directory, an earlier mtpkit output" in lines[0]
    assert tree_hashes(tmp_path) == before


@pytest.mark.parametrize("what", ["empty", "model", "earlier_output"])
def test_force_replaces_empty_model_and_earlier_output_directories(checkpoint, tmp_path, what):
    src = checkpoint("mimo")
    out = tmp_path / "out"
    if what == "empty":
        out.mkdir()
    elif what == "model":
        shutil.copytree(checkpoint("mlx_plain", dtype="bfloat16"), out)
    else:
        assert runner.invoke(app, ["convert", str(src), "-o", str(out), "--quiet"]).exit_code == 0
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--force", "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "mtp" / "manifest.json").is_file()
    assert out.stat().st_mode & 0o777 == 0o777 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_check_refuses_a_report_inside_the_source_and_writes_it_atomically(checkpoint, tmp_path):
    model = Path(shutil.copytree(checkpoint("mimo"), tmp_path / "model"))
    before = tree_hashes(model)
    for report in (model / "config.json", model / "report.xml"):
        result = runner.invoke(app, ["check", str(model), "--no-probe", "--junit", str(report)])
        assert result.exit_code == 1
        assert result.stderr.splitlines() == [
            f"Error: --junit {report} lies inside the source {model}: write it outside the source"
        ]
    assert tree_hashes(model) == before
    elsewhere = tmp_path / "reports" / "check.xml"
    victim = tmp_path / "victim.txt"
    victim.write_text("not a report\n")
    elsewhere.parent.mkdir()
    elsewhere.symlink_to(victim)  # replaced, never written through
    result = runner.invoke(app, ["check", str(model), "--no-probe", "--junit", str(elsewhere)])
    assert result.exit_code in (0, 3), result.output
    assert victim.read_text() == "not a report\n"
    assert not elsewhere.is_symlink() and elsewhere.read_text().startswith("<?xml")
    assert sorted(p.name for p in elsewhere.parent.iterdir()) == ["check.xml"]


def test_junit_streams_into_a_fifo_and_never_replaces_it(checkpoint, tmp_path):
    """A FIFO given to --junit receives the report and stays a FIFO (issue 33 item 2); one
    that nobody reads from is one line, never a hang."""
    model = checkpoint("mimo")
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the report fits the pipe's buffer
    try:
        result = runner.invoke(app, ["check", str(model), "--no-probe", "--junit", str(fifo)])
        assert result.exit_code in (0, 3), result.output
        os.set_blocking(reader, True)
        received = os.read(reader, 1 << 16).decode()
    finally:
        os.close(reader)
    assert received.startswith("<?xml") and received.rstrip().endswith("</testsuites>")
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["report.fifo"]
    result = runner.invoke(app, ["check", str(model), "--no-probe", "--junit", str(fifo)])
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (
        f"Error: cannot write --junit {fifo}: it is a FIFO or socket nobody reads from"
    )
    assert fifo.is_fifo()


def test_junit_through_a_link_to_stdout_reaches_stdout(checkpoint, tmp_path):
    """`--junit /dev/stdout` (a link to /proc/self/fd/1) writes the report where stdout goes
    and leaves the link alone; a link of the test's own stands in for /dev/stdout."""
    model = checkpoint("mimo")
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    captured = tmp_path / "captured.txt"
    with captured.open("w") as stdout:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mtpkit",
                "check",
                str(model),
                "--no-probe",
                "--junit",
                str(link),
            ],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=600,
        )
    assert proc.returncode in (0, 3), proc.stderr
    text = captured.read_text()
    # Written through the descriptor itself: neither the report nor the table overwrites
    # the other.
    assert text.count("<?xml") == 1 and "</testsuites>\n" in text and "verdict: " in text
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"


def test_failed_graft_leaves_the_directory_as_it_was(checkpoint, tmp_path, monkeypatch):
    import mtpkit.convert.grafting

    trunk = tmp_path / "trunk"
    shutil.copytree(checkpoint("mlx_plain", dtype="bfloat16"), trunk)
    dead = dead_pid()
    (trunk / f".config.json.mtpkit-tmp-{dead}").write_text("{")
    before = tree_hashes(trunk)
    del before[f".config.json.mtpkit-tmp-{dead}"]

    def disk_full(path, manifest):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mtpkit.convert.grafting, "write_manifest", disk_full)
    result = runner.invoke(
        app, ["convert", str(checkpoint("qwen3_5")), "--mtp-only", "--into", str(trunk)]
    )
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (
        f"Error: grafting into {trunk} failed, nothing was changed: "
        "[Errno 28] No space left on device"
    )
    assert tree_hashes(trunk) == before
    assert not (trunk / "mtp").exists()


def test_pid_alive_and_temp_sibling_names(tmp_path):
    assert pid_alive(os.getpid()) and pid_alive(os.getppid())
    assert not pid_alive(dead_pid())
    assert temp_sibling(tmp_path / "out") == tmp_path / f".out.mtpkit-tmp-{os.getpid()}"


def test_check_removes_the_scratch_copies_of_killed_checks(checkpoint, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MTPKIT_CACHE", str(cache))
    dead, live = dead_pid(), os.getppid()
    stale = cache / f"check-{dead}-abc123"
    (stale / "converted").mkdir(parents=True)
    running = cache / f"check-{live}-def456"
    running.mkdir()
    prompts = tmp_path / "prompts.json"
    prompts.write_text('["Say hi."]')
    args = ["check", str(checkpoint("mimo")), "--prompts", str(prompts), "--max-tokens", "4"]
    result = runner.invoke(app, args)
    assert result.exit_code in (0, 3), result.output
    assert f"removing {stale}, left by an earlier run that did not finish" in result.stderr
    assert not stale.exists() and running.exists()
    assert sorted(p.name for p in cache.iterdir()) == [running.name]  # its own copy is gone


def test_a_signal_during_a_file_swap_waits_until_every_file_is_moved(tmp_path, monkeypatch):
    """SIGTERM arriving between a graft's renames is delivered after the last one: the
    directory holds all new files or none, never a mix."""
    import signal

    from mtpkit.convert.destination import FileSwap
    from mtpkit.core import signals

    root = tmp_path / "model"
    root.mkdir()
    targets = [root / name for name in ("a.safetensors", "manifest.json", "config.json")]
    for target in targets:
        target.write_text("old")
    swap = FileSwap(root)
    for target in targets:
        swap.temp_for(target).write_text("new")
    real_replace = os.replace
    moved = []

    def replace(src, dst):
        if not moved:
            os.kill(os.getpid(), signal.SIGTERM)  # between the first rename and the others
        real_replace(src, dst)
        moved.append(dst)

    monkeypatch.setattr(os, "replace", replace)
    # `_raise` sets SIGTERM and SIGHUP to be ignored; both are put back for the later tests
    # (an ignored signal is inherited by their subprocesses).
    previous = {sig: signal.getsignal(sig) for sig in signals.TERMINATING}
    signal.signal(signal.SIGTERM, signals._raise)
    try:
        with pytest.raises(signals.Interrupted):
            swap.commit()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(moved) == 3 and [t.read_text() for t in targets] == ["new"] * 3


def test_an_output_made_while_converting_is_never_replaced_without_force(
    checkpoint, tmp_path, monkeypatch
):
    """The "already exists" rule is judged again at the final rename (issue 33 item 4): a
    folder that appeared at -o while the run wrote (a retry in another terminal) is kept."""
    from mtpkit.convert import pipeline

    src, out = checkpoint("mimo"), tmp_path / "out"
    real_write = pipeline._write_output

    def another_terminal_writes_out(*args, **kwargs):
        real_write(*args, **kwargs)
        out.mkdir()
        (out / "mine.txt").write_text("kept\n")

    monkeypatch.setattr(pipeline, "_write_output", another_terminal_writes_out)
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {out} appeared while this run was writing it (another run or program made "
        "it): nothing was replaced; pass --force to replace it, or choose another -o"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def test_two_converts_to_one_output_are_exclusive(checkpoint, tmp_path, monkeypatch):
    """A second convert to an output another run is writing (a real second process, started
    while the first writes) is refused at once, naming the first; the first completes."""
    from mtpkit.convert import pipeline

    src, out = checkpoint("mimo"), tmp_path / "out"
    real_write = pipeline._write_output
    second: list[subprocess.CompletedProcess] = []

    def second_run_meanwhile(*args, **kwargs):
        second.append(
            subprocess.run(
                [sys.executable, "-m", "mtpkit", "convert", str(src), "-o", str(out), "--quiet"],
                capture_output=True,
                text=True,
                timeout=600,
            )
        )
        real_write(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_write_output", second_run_meanwhile)
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"wrote {out}: ")
    assert second[0].returncode == 1 and second[0].stdout == ""
    assert second[0].stderr.splitlines() == [
        f"Error: {out} is being written by another mtpkit run (process {os.getpid()}): wait "
        "for it to finish, or choose another -o"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no lock file left
    assert (out / "mtp" / "manifest.json").is_file()


@pytest.mark.parametrize("side", ["vocab.txt", "tokenizer.json"])
def test_side_files_linking_out_of_the_source_are_never_copied(checkpoint, tmp_path, side):
    """A side file that links out of the source (a token file, /etc/shadow) is refused before
    anything is written (issue 33 item 5); links inside the source are followed."""
    model = Path(shutil.copytree(checkpoint("mimo"), tmp_path / "model"))
    secret = tmp_path / "token"
    secret.write_text("hf_secret_token\n")
    (model / side).unlink(missing_ok=True)
    (model / side).symlink_to(secret)
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(model), "-o", str(out), "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {model / side} is a link to {secret}, outside the source {model}: mtpkit "
        "copies and publishes no file from outside it; replace the link with the file itself"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "token"]


def test_side_files_are_what_they_claim_and_links_inside_are_followed(checkpoint, tmp_path):
    model = Path(shutil.copytree(checkpoint("mimo"), tmp_path / "model"))
    (model / "tokenizer.json").rename(model / "real-tokenizer.json")
    (model / "tokenizer.json").symlink_to("real-tokenizer.json")
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(model), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    copied = out / "tokenizer.json"
    assert not copied.is_symlink()
    assert copied.read_bytes() == (model / "real-tokenizer.json").read_bytes()
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").write_text("root:x:0:0:root:/root:/bin/bash\n")
    result = runner.invoke(app, ["convert", str(model), "-o", str(tmp_path / "o2"), "--quiet"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"Error: {model / 'tokenizer.json'} is not JSON as its name says (JSONDecodeError): "
        "mtpkit copies no side file that is not what it claims to be; restore it from the "
        "original"
    ]
    assert not (tmp_path / "o2").exists()


def test_a_cache_snapshot_converts_through_its_links_into_blobs(hf_cache, tmp_path):
    snapshot = hf_cache / "snapshots" / "0123abcd"
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(snapshot), "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").read_bytes() == (snapshot / "tokenizer.json").read_bytes()


def test_a_refused_convert_leaves_no_directory_for_its_lock(checkpoint, tmp_path):
    """The lock beside the output needs its parent; a run refused before writing removes
    the parents it made for it."""
    src = checkpoint("mimo")
    out = tmp_path / "new" / "deeper" / "out"
    result = runner.invoke(
        app, ["convert", str(src), "-o", str(out), "--q-mode", "nvfp4", "--q-group-size", "7"]
    )
    assert result.exit_code == 2
    result = runner.invoke(app, ["convert", str(src), "-o", str(out), "--layout", "inline"])
    assert result.exit_code == 1, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []
