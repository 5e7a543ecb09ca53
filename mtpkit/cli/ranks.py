"""A command run as one rank of `mlx.launch`: rank 0 prints, the others are silent, and a
failure ends every rank with one line.

- A rank whose peer exits sees MLX's "[ring] connection to a peer was lost" as an exception:
  it becomes `Error: rank N: ...` and exit 1, like any other error (MLX's ring backend also
  writes a "[ring] ..." line per failed socket; those are dropped unless MLX_RING_VERBOSE=1).
  At times the ring waits on a dead peer's socket instead of raising: the watchdog below
  ends that wait too.
- A rank whose peer stops answering (a stopped process, a pulled cable, a rank that never
  started or runs another command) would wait inside a collective, or in the ring's set-up,
  forever: the watchdog (`mtpkit.runtime.ranks.Watchdog`), armed from the rank's start, ends
  it after `--timeout` seconds of waiting (a rank's own loading is not counted).
- Ranks given different commands or models stop before decoding, rank 0 naming the
  difference (`mtpkit.runtime.ranks.agree`); a port of the ring that is taken is named.

- A rank that crashes in native code (MLX's ring backend has been seen to die of a
  segmentation fault when a peer is killed mid-round) is reported by `supervise_rank`: each
  rank runs as a child of a small parent process that turns a death by signal into one line.

`mlx.launch` itself exits 0 whatever its ranks do and adds its own "[WARN] Node with rank N
exited with code 1" line; the ranks' exit codes are each rank's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from mtpkit.core.errors import MtpkitError, one_line

if TYPE_CHECKING:  # the supervising parent imports nothing heavy
    import typer

DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    size: int = 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def _drop_ring_noise() -> None:
    """Route the process's fd 2 through a thread that drops MLX's "[ring] ..." socket lines;
    Python's own `sys.stderr` writes straight to the terminal (so no error line can be lost
    in the thread at exit)."""
    if os.environ.get("MLX_RING_VERBOSE"):
        return
    terminal = os.dup(2)
    sys.stderr.flush()
    sys.stderr = open(terminal, "w", buffering=1, closefd=False)  # noqa: SIM115
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        pending = b""
        while chunk := os.read(read_end, 65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [line for line in lines if not line.startswith(b"[ring]")]
            if kept:
                os.write(terminal, b"\n".join(kept) + b"\n")

    threading.Thread(target=forward, daemon=True, name="mtpkit-stderr").start()


def _exit_with(line: str) -> NoReturn:
    """One line on stderr, what stdout holds flushed, and exit 1 at once."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(1)


def _lost_peer(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and str(error).startswith("[ring]")


def rank_number() -> int | None:
    """This process's rank under `mlx.launch` (or mpirun), None when it is not one."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK"):
        if (value := os.environ.get(name)) is not None:
            with contextlib.suppress(ValueError):
                return int(value)
    return None


REFUSAL_WAIT = 60.0  # how long another rank waits for rank 0's line before it exits anyway


def refuse_on_ranks(message: str) -> NoReturn:
    """End every rank with exit 1, rank 0 with the line `Error: message` (each rank would
    say the same). The other ranks exit after rank 0: mlx.launch ends every rank once one
    exits, so one that left first could end rank 0 before its line was written. They wait
    silently for that SIGTERM (or REFUSAL_WAIT seconds)."""
    if rank_number() == 0:
        _exit_with(f"Error: {message}")
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: os._exit(1))
    threading.Event().wait(REFUSAL_WAIT)
    os._exit(1)


def command_facts(ctx: typer.Context, per_rank: Iterable[str] = ()) -> dict[str, str]:
    """What the ranks must agree on from a command line: the command and each option's
    parsed value, but for `per_rank` ones (the model's path, which may differ between
    machines and is compared by its files; what only rank 0's printing uses)."""
    from mtpkit.runtime.ranks import facts_of

    given = {
        f"--{name.replace('_', '-')}": value
        for name, value in ctx.params.items()
        if name not in set(per_rank)
    }
    return facts_of({"command": ctx.info_name, **given, "arguments": ctx.args})


def _ring_address(rank: int) -> str:
    """This rank's address in mlx.launch's ring hostfile (MLX_HOSTFILE: a file's path, or its
    JSON itself), as `ip:port`; "its port" when it cannot be read."""
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    with contextlib.suppress(OSError, ValueError, TypeError, IndexError):
        text = open(hostfile).read() if os.path.isfile(hostfile) else hostfile  # noqa: SIM115
        return ", ".join(json.loads(text)[rank])
    return "its port"


def _join(rank: int) -> Any:
    """The group of the ranks (None: a single process), with the ring's set-up failures as
    one line."""
    from mtpkit.runtime.sharded import world

    try:
        return world()
    except RuntimeError as e:
        if "bind" in str(e):
            raise MtpkitError(
                f"cannot listen on {_ring_address(rank)}: the port is taken (by another "
                "program, or a run still ending): choose free ports (mlx.launch "
                "--starting-port, or the hostfile)"
            ) from None
        raise


@contextlib.contextmanager
def on_ranks(
    timeout: float = DEFAULT_TIMEOUT, facts: Mapping[str, str] | None = None
) -> Iterator[Ranks]:
    """Within the block: this process's rank (rank 0 of 1 without `mlx.launch`); as one of
    several, errors name the rank, the watchdog bounds every wait from the ring's set-up on,
    the ranks agree on `facts` (`command_facts`) before the block, and meet after it."""
    rank = rank_number()
    if rank is None:
        yield Ranks()
        return
    if not timeout > 0:
        raise MtpkitError(f"--timeout must be a positive number of seconds, not {timeout}")
    from mtpkit.runtime.ranks import WATCHDOG, Watchdog, agree, meet

    _drop_ring_noise()

    def on_timeout(idle: float) -> None:
        _exit_with(
            f"Error: rank {rank}: no progress for {idle:.0f} s: another rank failed, stopped, "
            "never started or runs another command, or the network between the machines "
            "broke (--timeout sets the limit)"
        )

    watchdog = WATCHDOG[0] = Watchdog(timeout, on_timeout)
    watchdog.arm()
    try:
        group = _join(rank)
    except Exception as e:
        _fail(rank, e)
    if group is None:  # one process after all
        watchdog.stop()
        WATCHDOG[0] = None
        yield Ranks()
        return
    try:
        if facts is not None:
            agree(group, "command", facts)
        yield Ranks(group.rank(), group.size())
        meet(group)
    except Exception as e:
        _fail(rank, e)


def _fail(rank: int, error: Exception) -> NoReturn:
    """End this rank for `error` with one `Error: rank N: ...` line (none where rank 0 says
    it for every rank), exit 1."""
    from mtpkit.runtime.ranks import RanksDisagree

    if os.environ.get("MTPKIT_DEBUG") == "1":
        raise error
    if isinstance(error, RanksDisagree) and rank != 0:
        os._exit(1)  # rank 0 names the difference; every rank found the same
    if _lost_peer(error):
        message = (
            "lost the connection to another rank (it failed, or the network between the "
            "machines broke)"
        )
    else:
        message = one_line(error)
    # Ends here: an interpreter teardown races MLX's backend threads, whose sockets are
    # broken, and has crashed a rank after its error line.
    _exit_with(f"Error: rank {rank}: {message}")


CHILD_MARK = "MTPKIT_RANK_CHILD"


def supervise_rank(argv: list[str]) -> int | None:
    """As one rank of `mlx.launch` (MLX_RANK set): run the command in a child process and
    return its exit code, turning a death by signal into one `Error: rank N: ...` line (the
    child is the rank; this parent imports nothing heavy). None when not a rank, or already
    the child: run the command here."""
    rank = os.environ.get("MLX_RANK")
    if rank is None or os.environ.get(CHILD_MARK) or os.environ.get("MTPKIT_DEBUG") == "1":
        return None
    child = subprocess.Popen(
        [sys.executable, "-m", "mtpkit", *argv], env=os.environ | {CHILD_MARK: "1"}
    )

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    code = child.wait()
    if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL):
        name = signal.Signals(-code).name
        sys.stderr.write(
            f"Error: rank {rank}: crashed ({name}); if another rank failed or the network "
            "broke, its line says why\n"
        )
        return 1
    return code if code >= 0 else 128 - code
