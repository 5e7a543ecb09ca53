"""Ranks given what they cannot run together, and how they end: real `mlx.launch` processes
(or ranks started by hand as it starts them) with the ring backend over loopback.

Each case either decodes what one process decodes, or ends every rank with exit 1 and one
line on rank 0 naming the cause; none may hang (each run has a generous limit, so a busy
machine only makes it slower). The models are tiny: the bundled example (hidden 128, which
does not split 3 ways) and the tests' own fixtures.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.convert.pipeline import convert
from tests import hub_server
from tests.checkpoints import build_checkpoint
from tests.hub_server import HubStandIn
from tests.test_distributed import (
    LAUNCH_LIMIT,
    ROOT,
    end_rank,
    free_port_base,
    mtpkit_cli,
    rank_env,
    start_ranks,
)

hub = hub_server.hub  # the fixture
PROMPT = "def f(x):"


def stock_tokens(path: Path, n: int) -> list[int]:
    """Stock mlx-lm's greedy tokens in this one process (no chat template)."""
    model, tokenizer = mlx_lm.load(str(path))
    prompt = mx.array(tokenizer.encode(PROMPT))
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n)]


def launch_cli(n: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`mlx.launch -n N --backend ring -- mtpkit ARGS`, its stdin empty (as in CI). A run past
    LAUNCH_LIMIT fails, its ranks killed with mlx.launch (its process group)."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    command = [str(launcher), "-n", str(n), "--backend", "ring"]
    command += ["--starting-port", str(free_port_base(n)), "--", mtpkit_cli(), *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env(),
        cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=LAUNCH_LIMIT)
    finally:
        if proc.poll() is None:
            end_rank(proc)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error")]


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    """Each hand-started rank's (stdout, stderr) once it ended; any left is killed."""
    try:
        return [p.communicate(timeout=LAUNCH_LIMIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                end_rank(p)


def test_pipeline_stages_without_mtp_decode_every_token(converted: Path) -> None:
    """`--pipeline --no-mtp` (stock `stream_generate` on each rank) used to end with "lost
    the connection to another rank" before its last token in every run: mlx-lm queues the
    step after the last token, and rank 1 exited (closing its sockets) while rank 0 still
    needed its part of that step. Now the ranks meet before any exits."""
    done = launch_cli(
        2, "generate", "--model", str(converted), "-p", PROMPT, "-m", "16", "--no-chat-template",
        "--no-mtp", "--pipeline", "--json",
    )  # fmt: skip
    assert errors(done.stderr) == [], done.stderr
    assert json.loads(done.stdout)["tokens"] == stock_tokens(converted, 16)


def test_three_ranks_fall_back_to_pipeline_stages(converted: Path) -> None:
    """Hidden 128 does not split 3 ways for tensor parallelism (mlx-lm's ValueError used to
    end every rank): Qwen3.5 has pipeline stages, which run instead, with MTP."""
    done = launch_cli(
        3, "generate", "--model", str(converted), "-p", PROMPT, "-m", "8", "--no-chat-template",
        "--mtp", "--depth", "1", "--json",
    )  # fmt: skip
    assert errors(done.stderr) == [], done.stderr
    result = json.loads(done.stdout)
    assert result["tokens"] == stock_tokens(converted, 8)
    assert result["drafted"] > 0


def test_a_stdin_prompt_is_refused_on_ranks(converted: Path) -> None:
    """mlx.launch hands every rank a stdin it never closes: `-p -` used to wait forever.
    Now one line (rank 0's) says to pass the prompt as text."""
    done = launch_cli(2, "generate", "--model", str(converted), "-p", "-", "-m", "2")
    assert errors(done.stderr) == [
        "Error: --prompt - reads standard input, which mlx.launch hands every rank without "
        'ever closing it: pass the prompt as text (-p "$(cat FILE)")'
    ], done.stderr
    assert done.stdout == ""


def test_a_ranks_usage_error_names_mtpkit() -> None:
    """A rank's command runs as `python -m mtpkit` under its supervisor; its usage line still
    says `mtpkit`, as the command the user typed."""
    done = launch_cli(2, "generate", "--no-such-flag")
    lines = done.stderr.splitlines()
    assert "Usage: mtpkit generate [OPTIONS]" in lines, done.stderr
    assert "python -m mtpkit" not in done.stderr


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (["--max-tokens", "40"], "--max-tokens is 40 there, 12 on rank 0"),
        (["--max-tokens", "12", "--pipeline"], "--pipeline is true there, false on rank 0"),
    ],
    ids=["max-tokens", "pipeline"],
)
def test_ranks_given_different_commands_name_the_difference(
    converted: Path, tmp_path: Path, other: list[str], named: str
) -> None:
    """Rank 1 given another --max-tokens used to crash (SIGSEGV) or, given --pipeline alone,
    to deadlock: now every rank ends before loading, rank 0 naming the option."""
    common = ["generate", "--model", str(converted), "-p", PROMPT, "--no-chat-template", "--mtp"]
    procs = start_ranks(
        2, tmp_path, *common, "--max-tokens", "12",
        per_rank_args={1: [*common, *other]},
    )  # fmt: skip
    (_, err0), (out1, err1) = finish(procs)
    assert [p.returncode for p in procs] == [1, 1]
    assert errors(err0) == [
        f"Error: rank 0: rank 1 was given another command: {named}; give every rank the same "
        "command"
    ], err0
    assert out1 == "" and errors(err1) == [], err1  # rank 0 alone says it


@pytest.fixture(scope="module")
def other_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Converted Qwen3.5 fixtures of the same shapes from two sources (other weights), and a
    DeepSeek-V3 one (another family)."""
    out = {}
    for name, layout, seed in (("a", "qwen3_5", 0), ("b", "qwen3_5", 1), ("ds", "deepseek_v3", 0)):
        tmp = tmp_path_factory.mktemp(name)
        convert(
            str(build_checkpoint(layout, tmp / "src", dtype="float32", seed=seed)),
            output=tmp / "mlx",
        )
        out[name] = tmp / "mlx"
    return out


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ("b", 'mtp/manifest.json.source.spec is ".*/b0/src" there, ".*/a0/src" on rank 0'),
        ("ds", 'config.json.model_type is "deepseek_v3" there, "qwen3_5" on rank 0'),
    ],
    ids=["other-weights", "other-family"],
)
def test_ranks_given_different_models_name_the_difference(
    other_models: dict[str, Path], tmp_path: Path, other: str, named: str
) -> None:
    """Rank 1 given a model of the same shapes but other weights used to decode a hybrid of
    the two with exit 0; given another family, to wait out the timeout. Now the ranks compare
    config.json and the manifest before loading weights, and rank 0 names the difference."""

    def command(model: Path) -> list[str]:
        return ["generate", "--model", str(model), "-p", PROMPT, "--no-chat-template", "-m", "4"]

    procs = start_ranks(
        2, tmp_path, *command(other_models["a"]),
        per_rank_args={1: command(other_models[other])},
    )  # fmt: skip
    (out0, err0), (_, err1) = finish(procs)
    assert [p.returncode for p in procs] == [1, 1], err0
    [line] = errors(err0)
    assert re.fullmatch(
        f"Error: rank 0: rank 1 was given another model: {named}; give every rank the same model",
        line,
    ), err0
    assert out0 == "" and errors(err1) == []


@pytest.fixture
def stalled(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[str]]]:
    """The stand-in Hub's file listings (`/tree`) and weight downloads never answer while the
    test runs; the paths asked for are recorded as they come."""
    release = threading.Event()
    asked: dict[str, list[str]] = {"tree": [], "weights": []}
    tree, resolve = hub_server._Handler._tree, hub_server._Handler._resolve

    def stalled_tree(self, repo, commit, path, query):  # noqa: ANN001, ANN202
        asked["tree"].append(path)
        release.wait()
        return tree(self, repo, commit, path, query)

    def stalled_resolve(self, method, repo, revision, filename):  # noqa: ANN001, ANN202
        if method == "GET" and filename.endswith(".safetensors"):
            asked["weights"].append(filename)
            release.wait()
        return resolve(self, method, repo, revision, filename)

    monkeypatch.setattr(hub_server._Handler, "_tree", stalled_tree)
    monkeypatch.setattr(hub_server._Handler, "_resolve", stalled_resolve)
    yield asked
    release.set()


def test_a_rank_stopped_while_loading_ends_the_others(
    hub: HubStandIn, converted: Path, tmp_path: Path, stalled: dict[str, list[str]]
) -> None:
    """Rank 1 loads from the Hub, whose weight download stalls, and is then stopped; rank 0,
    loaded from its own copy, used to wait for it forever (the watchdog was armed only at the
    first decoding step). Now it ends after --timeout with one line; rank 1's own download
    is its own work, which the watchdog does not count."""
    hub.add_repo("org/tiny", converted)

    def command(model: str) -> list[str]:
        return ["generate", "--model", model, "-p", PROMPT, "--no-chat-template", "-m", "4",
                "--timeout", "20"]  # fmt: skip

    procs = start_ranks(
        2, tmp_path, *command(str(converted)),
        # Rank 1 runs unsupervised (MTPKIT_RANK_CHILD), so that SIGSTOP reaches the rank itself.
        per_rank={1: {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DOWNLOAD_TIMEOUT": "3600",
                      "MTPKIT_RANK_CHILD": "1"}},
        per_rank_args={1: command("org/tiny")},
    )  # fmt: skip
    root, other = procs
    try:
        for _ in range(LAUNCH_LIMIT * 10):  # until rank 1 is in the middle of its download
            if stalled["weights"] or other.poll() is not None:
                break
            time.sleep(0.1)
        assert stalled["weights"], other.communicate()
        other.send_signal(signal.SIGSTOP)
        _, err = root.communicate(timeout=LAUNCH_LIMIT)
    finally:
        for p in procs:
            if p.poll() is None:
                end_rank(p)
    assert root.returncode == 1, err
    [line] = errors(err)
    assert re.fullmatch(
        r"Error: rank 0: no progress for \d+ s: another rank failed, stopped, never started or "
        r"runs another command, or the network between the machines broke \(--timeout sets "
        r"the limit\)",
        line,
    ), err


def test_a_taken_ring_port_is_named(converted: Path, tmp_path: Path) -> None:
    """Rank 1's port of the ring held by another program: rank 1 says which rank and which
    port (it used to be "unexpected RuntimeError: [ring] Couldn't bind socket"); rank 0,
    left waiting for it, ends after the join's limit (it used to be --timeout, which now
    bounds only the waits after the ranks joined and compared their commands)."""
    base = free_port_base(2)
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base}"], [f"127.0.0.1:{base + 1}"]]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        args = ["generate", "--model", str(converted), "-p", PROMPT, "--timeout", "10"]
        env = {"MLX_HOSTFILE": str(hostfile), "MTPKIT_RANKS_JOIN_TIMEOUT": "10"}
        procs = start_ranks(2, tmp_path, *args, per_rank={r: env for r in (0, 1)})
        (_, err0), (_, err1) = finish(procs)
    assert [p.returncode for p in procs] == [1, 1]
    assert errors(err1) == [
        f"Error: rank 1: cannot listen on 127.0.0.1:{base + 1}: the port is taken (by another "
        "program, or a run still ending): choose free ports (mlx.launch --starting-port, or "
        "the hostfile)"
    ], err1
    [line] = errors(err0)
    assert line.startswith("Error: rank 0: the ranks did not all join and compare "), err0
