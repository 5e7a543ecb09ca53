"""A command run as one rank of `mlx.launch`: rank 0 prints, the others are silent, and a
failure ends every rank with one line.

- A rank whose peer exits sees MLX's "[ring] connection to a peer was lost" as an exception:
  it becomes `Error: rank N: ...` and exit 1, like any other error (MLX's ring backend also
  writes a "[ring] ..." line per failed socket; those are dropped unless MLX_RING_VERBOSE=1).
- A rank whose peer stops answering (a stopped process, a pulled cable) would wait inside a
  collective forever: the watchdog (`mtpkit.runtime.ranks.Watchdog`) ends it after
  `--timeout` seconds without a decoding step.

`mlx.launch` itself exits 0 whatever its ranks do and adds its own "[WARN] Node with rank N
exited with code 1" line; the ranks' exit codes are each rank's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from mtpkit.core.errors import MtpkitError, one_line

DEFAULT_TIMEOUT = 300.0


class RankFailed(MtpkitError):
    """This rank failed, or lost the other ranks."""


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
        sys.stderr.write(
            f"Error: rank {ranks.rank}: no progress for {idle:.0f} s: another rank stopped or "
            "the network between the machines broke (--timeout sets the limit)\n"
        )
        sys.stderr.flush()
        os._exit(1)

    WATCHDOG[0] = Watchdog(timeout, on_timeout)
    try:
        yield ranks
    except Exception as e:
        if os.environ.get("MTPKIT_DEBUG") == "1":
            raise
        if _lost_peer(e):
            raise RankFailed(
                f"rank {ranks.rank}: lost the connection to another rank (it failed, or the "
                "network between the machines broke)"
            ) from None
        raise RankFailed(f"rank {ranks.rank}: {one_line(e)}") from None
    finally:
        WATCHDOG[0] = None
