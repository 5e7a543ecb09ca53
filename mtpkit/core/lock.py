"""One writer per output: a lock file beside it (`.NAME.mtpkit-lock`).

`convert` holds it from its first check of the output to the final rename, and every
directory written through `mtpkit.convert.destination.new_directory` holds it while it is
written: a second run writing the same output (a retry in another terminal) is refused at
once, naming the first run's process. The kernel drops the lock of a killed run (`flock`);
the file it leaves is reused by the next run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtpkit.core.errors import MtpkitError

LOCK_MARK = "mtpkit-lock"
# Locks this process holds, by output path: taking one again (convert locks its output at
# the start, then writes it through `new_directory`) is a no-op.
_HELD: dict[Path, int] = {}


class OutputBusy(MtpkitError):
    """Another run is writing the same output."""


def lock_path(out: Path) -> Path:
    """The lock file beside `out` (`.NAME.mtpkit-lock`)."""
    return out.parent / f".{out.name}.{LOCK_MARK}"


@contextmanager
def exclusive_output(out: Path, *, option: str = "-o") -> Iterator[None]:
    """Hold the lock beside `out` for the block; the parent directories made for the lock
    are removed again when nothing was written there."""
    key = out.expanduser().resolve()
    if key in _HELD:
        yield
        return
    path = lock_path(out)
    missing = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path, out, option)
    except OSError as e:
        raise MtpkitError(f"cannot write {out}: {e.strerror or e}") from None
    _HELD[key] = fd
    try:
        yield
    finally:
        del _HELD[key]
        try:
            path.unlink(missing_ok=True)  # while still held: no other run holds this file
        except OSError:
            pass
        os.close(fd)
        for directory in missing:  # made for the lock, of a run that wrote nothing
            try:
                directory.rmdir()
            except OSError:  # not empty (the output is there) or gone
                break


def _acquire(path: Path, out: Path, option: str) -> int:
    """An open descriptor of the lock file `path`, locked; the file is checked to be the one
    at `path` still (a run that just finished unlinks its own)."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputBusy(
                f"{out} is being written by another mtpkit run (process {holder}): wait for "
                f"it to finish, or choose another {option}"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


__all__ = ["OutputBusy", "exclusive_output", "lock_path"]
