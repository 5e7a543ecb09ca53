"""A command run as one rank of `mlx.launch`: rank 0 prints, the others are silent, and a
failure ends every rank with one line.

- A rank whose peer exits sees MLX's "[ring] connection to a peer was lost" as an exception:
  it becomes `Error: rank N: ...` and exit 1, like any other error (MLX's ring backend also
  writes a "[ring] ..." line per failed socket; those are dropped unless MLX_RING_VERBOSE=1).
  At times the ring waits on a dead peer's socket instead of raising: the watchdog below
  ends that wait too.
- Ranks given different commands or models stop in their first exchange, rank 0 naming the
  difference (`mtpkit.runtime.ranks.agree`), before any step bounded by `--timeout`: the
  join and that comparison have a limit of their own (`join_limit`: ranks start at
  different times), so a short `--timeout` cannot end them first. A port of the ring that
  is taken is named.
- A rank whose peer stops answering (a stopped process, a pulled cable, a rank that never
  started or runs another command) would wait inside a collective, or in the ring's set-up,
  forever: the watchdog (`mtpkit.runtime.ranks.Watchdog`) ends it, after `join_limit` while
  the ranks join, then after `--timeout` seconds of waiting (a rank's own loading is not
  counted).

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
from collections.abc import Callable, Iterable, Iterator, Mapping
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


_EXITING = threading.Lock()


def _exit_with(line: str) -> NoReturn:
    """One line on stderr, what stdout holds flushed, and exit 1 at once; a second caller
    (a watchdog and an alarm both expired) waits for the first's exit."""
    if not _EXITING.acquire(blocking=False):
        threading.Event().wait()
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


JOIN_TIMEOUT = 120.0  # the least the ranks wait for each other to join and compare
JOIN_TIMEOUT_VARIABLE = "MTPKIT_RANKS_JOIN_TIMEOUT"
AFTER_ROOT_WAIT = 3.0  # how long another rank waits for rank 0 to exit first


def join_limit(timeout: float) -> float:
    """How long the ranks may take to join the ring and compare what they were given:
    MTPKIT_RANKS_JOIN_TIMEOUT seconds, by default the longer of JOIN_TIMEOUT and `timeout`
    (ranks start at different times: a loaded machine, a slow disk, an ssh login)."""
    text = os.environ.get(JOIN_TIMEOUT_VARIABLE)
    if text is None:
        return max(timeout, JOIN_TIMEOUT)
    try:
        limit = float(text)
    except ValueError:
        limit = float("nan")
    if not limit > 0:
        raise MtpkitError(
            f"{JOIN_TIMEOUT_VARIABLE} must be a positive number of seconds, not {text!r}"
        )
    return limit


def _given(facts: Mapping[str, str] | None, model: str | os.PathLike | None) -> dict:
    """What this rank compares with the others: the command's facts and the model's (its
    files but the weights: this rank's own work, before it waits on any other)."""
    given: dict[str, Mapping[str, str]] = {}
    if facts is not None:
        given["command"] = facts
    if model is not None:
        from mtpkit.runtime.sharded import given_model_facts

        given["model"] = given_model_facts(model)
    return given


@contextlib.contextmanager
def on_ranks(
    timeout: float = DEFAULT_TIMEOUT,
    facts: Mapping[str, str] | None = None,
    model: str | os.PathLike | None = None,
) -> Iterator[Ranks]:
    """Within the block: this process's rank (rank 0 of 1 without `mlx.launch`); as one of
    several, errors name the rank; the ranks join and compare `facts` (`command_facts`) and
    the `model`'s config and manifest in their first exchange, under `join_limit`; from then
    on the watchdog bounds every wait by `timeout`, and the ranks meet after the block."""
    rank = rank_number()
    if rank is None:
        yield Ranks()
        return
    if not timeout > 0:
        raise MtpkitError(f"--timeout must be a positive number of seconds, not {timeout}")
    from mtpkit.runtime.ranks import WATCHDOG, Watchdog, agree, meet

    _drop_ring_noise()
    group = None
    try:
        limit = join_limit(timeout)
        given = _given(facts, model)
    except Exception as e:
        _fail(rank, e, group)

    def on_join_timeout(idle: float) -> None:
        _exit_with(
            f"Error: rank {rank}: the ranks did not all join and compare their commands and "
            f"models within {limit:.0f} s: another rank failed, never started or runs another "
            f"command, or the network between the machines is down ({JOIN_TIMEOUT_VARIABLE} "
            "sets the limit)"
        )

    def on_timeout(idle: float) -> None:
        _exit_with(
            f"Error: rank {rank}: no progress for {idle:.0f} s: another rank failed, stopped, "
            "never started or runs another command, or the network between the machines "
            "broke (--timeout sets the limit)"
        )

    with _within(limit, on_join_timeout):  # also while a disagreement ends the ranks
        try:
            group = _join(rank)
            if group is not None:
                agree(group, given)
        except Exception as e:
            _fail(rank, e, group)
    if group is None:  # one process after all
        yield Ranks()
        return
    WATCHDOG[0] = Watchdog(timeout, on_timeout)
    WATCHDOG[0].arm()
    try:
        yield Ranks(group.rank(), group.size())
        meet(group)
    except Exception as e:
        _fail(rank, e, group)


@contextlib.contextmanager
def _within(limit: float, on_expiry: Callable[[float], None]) -> Iterator[None]:
    """Within the block, `on_expiry` after `limit` seconds. Two clocks: MLX's ring set-up
    waits in accept() holding the GIL, where no watchdog thread runs but SIGALRM interrupts
    it (on the main thread); a collective waits with the GIL released, where the thread
    does."""
    from mtpkit.runtime.ranks import WATCHDOG, Watchdog

    dog = WATCHDOG[0] = Watchdog(limit, on_expiry)
    dog.arm()
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        previous = signal.signal(signal.SIGALRM, lambda *_: on_expiry(limit))
        signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        if on_main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        dog.stop()
        WATCHDOG[0] = None


def _fail(rank: int, error: Exception, group: Any = None) -> NoReturn:
    """End this rank for `error` with one `Error: rank N: ...` line (none where rank 0 says
    it for every rank), exit 1."""
    from mtpkit.runtime.ranks import RanksDisagree

    if os.environ.get("MTPKIT_DEBUG") == "1":
        raise error
    if isinstance(error, RanksDisagree) and group is not None:
        _disagree(rank, error, group)
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


def _disagree(rank: int, error: Exception, group: Any) -> NoReturn:
    """Every rank found the same difference: rank 0 says it, then the ranks meet (its line
    is written), and rank 0 exits first: mlx.launch ends every rank once one exits, and
    would end rank 0 before its line, or report it killed. The others wait for that end
    (SIGTERM) or AFTER_ROOT_WAIT seconds, silently, and exit 1."""
    import mlx.core as mx

    if rank == 0:
        sys.stderr.write(f"Error: rank 0: {one_line(error)}\n")
        sys.stderr.flush()
    with contextlib.suppress(Exception):  # a rank gone now has been told (or failed)
        mx.distributed.all_sum(mx.array(1), group=group).item()
    if rank == 0:
        os._exit(1)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: os._exit(1))
    threading.Event().wait(AFTER_ROOT_WAIT)
    os._exit(1)


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
