"""Writing one file a user named (a report) without replacing what is not a file.

A regular file (or a path where nothing is) is replaced atomically: the text goes into a
temporary sibling that is renamed over it, so a reader never sees half a report. Anything else
receives the text as a stream, as a shell's `>` would give it: a FIFO, a character device
(`/dev/null`, a terminal), and `/dev/stdout`, `/dev/stderr`, `/dev/fd/N` or `/proc/self/fd/N`,
which are this process's own descriptors and are written through them (renaming a file over
`/dev/stdout` would replace the system's link, and the report would never reach stdout). A
link to a regular file elsewhere is replaced itself, never written through.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
from pathlib import Path

from mtpkit.core.errors import MtpkitError

# A path naming one of this process's descriptors (`/dev/stdout` links to the first form).
OWN_DESCRIPTOR = re.compile(r"^/(?:proc/(?:self|thread-self|\d+)/fd|dev/fd)/(\d+)$")
MAX_LINK_HOPS = 40  # as the kernel's own limit on a path's links


class FileWriteError(MtpkitError):
    """A file a user named cannot be written."""


def write_text_file(path: Path, text: str, *, option: str) -> None:
    """Write `text` to `path`: replace a regular file atomically, stream into anything else."""
    data = text.encode("utf-8")
    descriptor = own_descriptor(path)
    if descriptor is not None:
        _write_descriptor(descriptor, data, path, option)
        return
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise FileWriteError(f"cannot write {option} {path}: {_reason(e)}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise FileWriteError(f"{option} {path} is a directory: name a file")
    if mode is not None and stat.S_ISLNK(mode):
        try:
            mode = os.stat(path).st_mode  # what the link leads to
        except OSError:
            mode = None  # a broken link: replaced like a file
        if mode is not None and stat.S_ISDIR(mode):
            raise FileWriteError(f"{option} {path} is a link to a directory: name a file")
        if mode is not None and stat.S_ISREG(mode):
            mode = None  # never written through: the link itself is replaced
    if mode is None or stat.S_ISREG(mode):
        _replace(path, data, option)
    else:
        _stream(path, data, option)


def own_descriptor(path: Path) -> int | None:
    """The descriptor number `path` (or a link on its way) names in this process, if any."""
    current = os.path.abspath(os.path.expanduser(path))
    for _ in range(MAX_LINK_HOPS):
        match = OWN_DESCRIPTOR.match(current)
        if match and (match.group(0).startswith("/dev") or _this_process(current)):
            return int(match[1])
        if not os.path.islink(current):
            return None
        target = os.readlink(current)
        if not target.startswith("/"):
            current = os.path.normpath(os.path.join(os.path.dirname(current), target))
        else:
            current = target
    return None


def _this_process(path: str) -> bool:
    pid = path.split("/")[2]
    return pid in ("self", "thread-self") or int(pid) == os.getpid()


def _write_descriptor(descriptor: int, data: bytes, path: Path, option: str) -> None:
    for stream in (sys.stdout, sys.stderr):  # what was printed before comes first
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        _write_all(descriptor, data)
    except OSError as e:
        raise FileWriteError(f"cannot write {option} {path}: {_reason(e)}") from None


def _stream(path: Path, data: bytes, option: str) -> None:
    """Write into a special file. A FIFO is opened without waiting: one nobody reads from
    is an error, never a hang."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise FileWriteError(
                f"cannot write {option} {path}: it is a FIFO or socket nobody reads from"
            ) from None
        raise FileWriteError(f"cannot write {option} {path}: {_reason(e)}") from None
    try:
        os.set_blocking(fd, True)
        _write_all(fd, data)
    except OSError as e:
        raise FileWriteError(f"cannot write {option} {path}: {_reason(e)}") from None
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _replace(path: Path, data: bytes, option: str) -> None:
    tmp = path.parent / f".{path.name}.mtpkit-tmp-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as e:
        _discard(tmp)
        raise FileWriteError(f"cannot write {option} {path}: {_reason(e)}") from None
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:  # its parent is not a directory: there is nothing to remove
        pass


def _reason(e: OSError) -> str:
    return f"{e.strerror} ({e.filename})" if e.strerror and e.filename else str(e.strerror or e)


__all__ = ["FileWriteError", "own_descriptor", "write_text_file"]
