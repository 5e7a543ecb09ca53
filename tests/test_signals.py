"""Signals: SIGTERM and SIGHUP get Ctrl-C's cleanup, and no signal ends in a traceback.

Each case is a real `python -m mtpkit` process. To hold it in the middle of writing, the
process's writer sleeps after its first file (patched in the child, the rest of the run is
the real code); the signal is sent once the child says it got there. Then: the exit code is
the shell's for the signal, stderr ends in one `Error: interrupted by SIG...` line, the source
and the destination are as they were, and no temporary sibling or scratch copy is left.

No limit here measures speed: each wait is for a line the child prints or for its exit, and
is generous (minutes) so that a busy machine only makes the tests slower. The child starts
with SIGHUP at its default, as a terminal's process has it: a suite run under `nohup` or by a
runner that ignores SIGHUP passes that on, and mtpkit rightly keeps an ignored SIGHUP ignored
(so the SIGHUP case used to wait out the writer's sleep there).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Seconds a child may take to end after its signal: a hang fails, a busy machine does not.
LIMIT = 300
# The child: the writer announces itself and waits to be killed, then the real CLI runs.
HELD = """
import sys, time
import mtpkit.convert.grafting as grafting
import mtpkit.convert.pipeline as pipeline
real = pipeline.write_job_files
def held(*args, **kwargs):
    real(*args, **kwargs)
    print("held in the writer", file=sys.stderr, flush=True)
    time.sleep(3600)
pipeline.write_job_files = grafting.write_job_files = held
sys.argv[0] = "mtpkit"
from mtpkit.cli.entry import main
main()
"""


def tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def child(
    args: list[str], env: dict[str, str] | None = None, sighup: signal.Handlers = signal.SIG_DFL
) -> subprocess.Popen:
    """The held CLI, started with SIGHUP at `sighup` (a terminal's default unless asked)."""
    return subprocess.Popen(
        [sys.executable, "-c", HELD, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGHUP, sighup),
    )


def held_then(proc: subprocess.Popen, *signals: int) -> tuple[int, list[str]]:
    """Wait for the child to reach the writer, send `signals` in turn (each after the
    previous one's effect, if any, had LIMIT seconds), return (exit code, stderr lines)."""
    assert proc.stderr is not None
    lines = []
    try:
        while True:  # the child's own line, however long a busy machine takes to get there
            line = proc.stderr.readline()
            assert line, f"the child ended before the writer: {lines}"
            lines.append(line.rstrip("\n"))
            if line.startswith("held in the writer"):
                break
        *first, last = signals
        for sig in first:
            proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)  # an ignored signal leaves it running
        proc.send_signal(last)
        _, rest = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, lines + rest.splitlines()


def hidden(*dirs: Path) -> list[str]:
    return [p.name for d in dirs if d.exists() for p in d.iterdir() if "mtpkit-" in p.name]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_convert_leaves_no_output(checkpoint, tmp_path, sig):
    source = checkpoint("mimo")
    before = tree(source)
    out = tmp_path / "out"
    code, lines = held_then(child(["convert", str(source), "-o", str(out)]), sig)
    assert code == 128 + sig, lines
    assert lines[-1] == f"Error: interrupted by {signal.Signals(sig).name}"
    assert not any("Traceback" in line for line in lines)
    assert not out.exists() and hidden(tmp_path) == []
    assert tree(source) == before


def test_an_ignored_sighup_stays_ignored(checkpoint, tmp_path):
    """Under `nohup` (SIGHUP ignored) the conversion goes on after a SIGHUP; a SIGTERM then
    still cleans up. (A suite run this way once made the SIGHUP case above wait out the
    writer's sleep, which read as a slow machine.)"""
    out = tmp_path / "out"
    proc = child(["convert", str(checkpoint("mimo")), "-o", str(out)], sighup=signal.SIG_IGN)
    code, lines = held_then(proc, signal.SIGHUP, signal.SIGTERM)
    assert code == 143 and lines[-1] == "Error: interrupted by SIGTERM", lines
    assert not out.exists() and hidden(tmp_path) == []


def test_sigterm_during_a_graft_leaves_the_model_as_it_was(checkpoint, tmp_path):
    into = Path(shutil.copytree(checkpoint("mlx_plain", dtype="bfloat16"), tmp_path / "into"))
    before = tree(into)
    args = ["convert", str(checkpoint("qwen3_5")), "--mtp-only", "--into", str(into)]
    code, lines = held_then(child(args), signal.SIGTERM)
    assert code == 143 and lines[-1] == "Error: interrupted by SIGTERM", lines
    assert tree(into) == before and not (into / "mtp").exists()
    assert hidden(into, tmp_path) == []


def test_sigterm_during_checks_conversion_leaves_no_scratch_copy(checkpoint, tmp_path):
    cache = tmp_path / "cache"
    prompts = tmp_path / "prompts.json"
    prompts.write_text('["Say hi."]')
    args = ["check", str(checkpoint("mimo")), "--prompts", str(prompts), "--max-tokens", "4"]
    code, lines = held_then(child(args, {"MTPKIT_CACHE": str(cache)}), signal.SIGTERM)
    assert code == 143 and lines[-1] == "Error: interrupted by SIGTERM", lines
    assert list(cache.iterdir()) == []


# The child says when Python itself is up (its own start is out of mtpkit's hands), then
# runs `python -m mtpkit` as runpy does.
STARTING = """
import runpy, sys
print("python is up", file=sys.stderr, flush=True)
sys.argv = ["mtpkit", *sys.argv[1:]]
runpy.run_module("mtpkit", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("delay", [0.05, 0.15])
def test_ctrl_c_while_starting_is_no_traceback(checkpoint, delay):
    proc = subprocess.Popen(
        [sys.executable, "-c", STARTING, "inspect", str(checkpoint("mimo"))],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and proc.stderr.readline() == "python is up\n"
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=LIMIT)
    assert "Traceback" not in err, err
    if proc.returncode != 0:  # else it had finished: an inspect takes a fraction of a second
        # One line, or none while Typer parses the command line (it exits 130 quietly).
        assert proc.returncode == 130 and len(err.splitlines()) <= 1, err
        assert err in ("", "Error: interrupted by SIGINT\n"), err


def test_ctrl_c_while_bench_builds_its_random_model_removes_it(tmp_path, monkeypatch):
    """The build is cut short after its first file, as a Ctrl-C would cut it."""
    import tempfile

    from typer.testing import CliRunner

    import mtpkit.bench.shapes as shapes
    from mtpkit.cli.app import app

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"mtpkit-bench-{dead_pid()}-qwen3_5-0.8b-x1"  # a run killed outright
    stale.mkdir()

    def interrupted_build(shape, out, **kwargs):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(shapes, "build_random_model", interrupted_build)
    result = CliRunner().invoke(app, ["bench", "--random", "qwen3_5-0.8b"])
    assert result.exit_code == 130
    assert result.stderr.splitlines()[-1] == "Error: interrupted by SIGINT"
    assert list(tmp_path.iterdir()) == []


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_signal_during_typers_start_up_is_one_error_line(monkeypatch, capsys):
    """Issue 48: SIGTERM while Typer builds the command (its first 0.6-1.2 s) ended with exit
    130 and nothing on stderr: Typer answers a KeyboardInterrupt there with a bare Exit(130).
    Raised here where the signal landed (making the command's context)."""
    import typer.core

    from mtpkit.cli.entry import main
    from mtpkit.core import signals
    from mtpkit.core.signals import Interrupted

    monkeypatch.setattr(signals, "install", lambda: None)  # the test's own handlers stay

    def interrupted(*args, **kwargs):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(typer.core.TyperGroup, "make_context", interrupted)
    monkeypatch.setattr(sys, "argv", ["mtpkit", "inspect", "x"])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == ["Error: interrupted by SIGTERM"]
