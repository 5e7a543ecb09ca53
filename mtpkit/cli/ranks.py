"""A command run as one rank of `mlx.launch`: rank 0 prints, the others are silent, and a
failure ends every rank with one line.

- A rank whose peer exits sees MLX's "[ring] connection to a peer was lost" as an exception:
  it becomes `Error: rank N: ...` and exit 1, like any other error (MLX's ring backend also
  writes a "[ring] ..." line per failed socket; those are dropped unless MLX_RING_VERBOSE=1).
- A rank whose peer stops answering (a stopped process, a pulled cable) would wait inside a
  collective forever: the watchdog (`mtpkit.runtime.ranks.Watchdog`) ends it after
  `--timeout` seconds without a decoding step.

- A rank that crashes in native code (MLX's ring backend has been seen to die of a
  segmentation fault when a peer is killed mid-round) is reported by `supervise_rank`: each
  rank runs as a child of a small parent process that turns a death by signal into one line.

`mlx.launch` itself exits 0 whatever its ranks do and adds its own "[WARN] Node with rank N
exited with code 1" line; the ranks' exit codes are each rank's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from mtpkit.core.errors import MtpkitError, one_line

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


def _exit_with(line: str) -> None:
    """One line on stderr, what stdout holds flushed, and exit 1 at once."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(1)


def _lost_peer(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and str(error).startswith("[ring]")


@contextlib.contextmanager
def on_ranks(timeout: float = DEFAULT_TIMEOUT) -> Iterator[Ranks]:
    """Within the block: this process's rank (rank 0 of 1 without `mlx.launch`); as one of
    several, errors name the rank and the watchdog bounds every wait."""
    if "MLX_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        yield Ranks()
        return
    from mtpkit.runtime.ranks import WATCHDOG, Watchdog
    from mtpkit.runtime.sharded import world

    group = world()
    if group is None:
        yield Ranks()
        return
    if timeout <= 0:
        raise MtpkitError(f"--timeout must be positive, not {timeout}")
    ranks = Ranks(group.rank(), group.size())
    _drop_ring_noise()

    def on_timeout(idle: float) -> None:
        _exit_with(
            f"Error: rank {ranks.rank}: no progress for {idle:.0f} s: another rank stopped or "
            "the network between the machines broke (--timeout sets the limit)"
        )

    WATCHDOG[0] = Watchdog(timeout, on_timeout)
    try:
        yield ranks
    except Exception as e:
        if os.environ.get("MTPKIT_DEBUG") == "1":
            raise
        if _lost_peer(e):
            message = (
                "lost the connection to another rank (it failed, or the network between the "
                "machines broke)"
            )
        else:
            message = one_line(e)
        # Ends here: an interpreter teardown races MLX's backend threads, whose sockets are
        # broken, and has crashed a rank after its error line.
        _exit_with(f"Error: rank {ranks.rank}: {message}")


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
