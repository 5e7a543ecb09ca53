"""How ranks start: they join the ring and compare their commands and models first, under a
limit of their own (`MTPKIT_RANKS_JOIN_TIMEOUT`, by default the longer of 120 s and
`--timeout`), so a short `--timeout` bounds only the waits that follow.

Real `mlx.launch -n 2 --backend ring` runs over loopback, each rank given its own command
line through a shell; rank 1 starts seconds after rank 0 (a loaded machine, a slow disk),
longer than `--timeout`: the ranks still name what differs. The reference is what the user
gave: the option and the config field that differ, and each rank's exit code as mlx.launch
reports it.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_distributed import (
    LAUNCH_LIMIT,
    ROOT,
    end_rank,
    free_port_base,
    mtpkit_cli,
    rank_env,
    start_ranks,
)

PROMPT = "def f(x):"
LATE_START = 6  # seconds rank 1 starts after rank 0: three times --timeout
TIMEOUT = "2"


def launch_per_rank(commands: dict[int, list[str]], late: float) -> subprocess.CompletedProcess:
    """`mlx.launch -n 2 --backend ring` of a shell that runs `commands[MLX_RANK]` (rank 1
    after `late` seconds). A run past LAUNCH_LIMIT fails, its ranks killed."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    line = {r: shlex.join([mtpkit_cli(), *args]) for r, args in commands.items()}
    script = f'if [ "$MLX_RANK" = 1 ]; then sleep {late}; exec {line[1]}; fi; exec {line[0]}'
    command = [str(launcher), "-n", "2", "--backend", "ring"]
    command += ["--starting-port", str(free_port_base(2)), "--", "/bin/sh", "-c", script]
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


@pytest.fixture(scope="module")
def longer_context(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled example with another context length in its config.json: the same weights,
    another model to the ranks."""
    out = tmp_path_factory.mktemp("other") / "tiny"
    shutil.copytree(converted, out)
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] *= 2
    (out / "config.json").write_text(json.dumps(config))
    return out


def generate(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "-p", PROMPT, "--no-chat-template",
            "--timeout", TIMEOUT, *extra]  # fmt: skip


@pytest.mark.parametrize("given", ["command", "model"])
def test_a_late_rank_given_another_command_or_model_is_named(
    converted: Path, longer_context: Path, given: str
) -> None:
    """Rank 1 starts 6 s late with `--timeout 2`. The ranks used to compare commands and
    models under --timeout, so rank 0 ended first with "no progress for 2 s ... or runs
    another command" (each rank with its own line); now the comparison is their first
    exchange, under the join's own limit: one line names the difference, exit 1 on both."""
    config = json.loads((converted / "config.json").read_text())
    context = config["text_config"]["max_position_embeddings"]
    if given == "command":
        commands = {0: generate(converted, "-m", "4"), 1: generate(converted, "-m", "40")}
        named = "command: --max-tokens is 40 there, 4 on rank 0"
    else:
        commands = {0: generate(converted, "-m", "4"), 1: generate(longer_context, "-m", "4")}
        named = (
            f"model: config.json.text_config.max_position_embeddings is {2 * context} there, "
            f"{context} on rank 0"
        )
    done = launch_per_rank(commands, LATE_START)
    assert errors(done.stderr) == [
        f"Error: rank 0: rank 1 was given another {named}; give every rank the same "
        f"{given}"
    ], done.stderr
    assert "[WARN] Node with rank 0 exited with code 1" in done.stderr, done.stderr
    assert "[WARN] Node with rank 1 exited with code 1" in done.stderr, done.stderr
    assert done.stdout == ""


def test_a_rank_that_never_joins_ends_the_others_after_the_join_limit(
    converted: Path, tmp_path: Path
) -> None:
    """Rank 1 runs another command (`mtpkit --version`), so never joins: rank 0 waits for it
    through the join's limit (here 3 s, set by MTPKIT_RANKS_JOIN_TIMEOUT), and ends with one
    line naming that limit."""
    procs = start_ranks(
        2, tmp_path, *generate(converted, "-m", "4"),
        per_rank={0: {"MTPKIT_RANKS_JOIN_TIMEOUT": "3"}}, per_rank_args={1: ["--version"]},
    )  # fmt: skip
    try:
        (_, err), (out1, _) = [p.communicate(timeout=LAUNCH_LIMIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                end_rank(p)
    assert [p.returncode for p in procs] == [1, 0], err
    assert out1.strip(), "rank 1 ran its own command"
    assert errors(err) == [
        "Error: rank 0: the ranks did not all join and compare their commands and models "
        "within 3 s: another rank failed, never started or runs another command, or the "
        "network between the machines is down (MTPKIT_RANKS_JOIN_TIMEOUT sets the limit)"
    ], err


def test_the_join_limit_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the longer of 120 s and --timeout; the variable replaces it; a value that
    is not a positive number is one line naming it."""
    from mtpkit.cli.ranks import join_limit
    from mtpkit.core.errors import MtpkitError

    monkeypatch.delenv("MTPKIT_RANKS_JOIN_TIMEOUT", raising=False)
    assert (join_limit(5.0), join_limit(300.0)) == (120.0, 300.0)
    monkeypatch.setenv("MTPKIT_RANKS_JOIN_TIMEOUT", "7.5")
    assert join_limit(300.0) == 7.5
    for bad in ("abc", "0", "-1", "nan"):
        monkeypatch.setenv("MTPKIT_RANKS_JOIN_TIMEOUT", bad)
        with pytest.raises(MtpkitError, match=f"not '{bad}'"):
            join_limit(5.0)
