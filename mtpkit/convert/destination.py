"""Where `convert` and graft write, and how, so that nothing they read is ever lost.

- An output that is the source, contains it, or lies inside it is refused, `--force` or not
  (paths resolved, symlinks followed): replacing an ancestor of the source would delete it.
- Everything is written into a temporary sibling `.NAME.mtpkit-tmp-PID` and renamed over the
  target at the end; an interrupted run removes its sibling, and one killed outright (SIGKILL,
  power loss) leaves it behind: the next run that writes there removes the siblings of runs
  whose process is gone, and says so.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from mtpkit.core.errors import MtpkitError

TEMP_MARK = "mtpkit-tmp"
OLD_MARK = "mtpkit-old"
# `.NAME.mtpkit-tmp-PID` (work in progress) or `.NAME.mtpkit-old-PID` (a replaced output).
SIBLING = re.compile(rf"^\.(?P<name>.+)\.(?:{TEMP_MARK}|{OLD_MARK})-(?P<pid>\d+)$")


def local_source_dir(spec: str) -> Path | None:
    """The directory a source spec names on this machine (as `open_source` decides), or None."""
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


def refuse_overlap(out: Path, source: Path | None, *, option: str = "-o") -> None:
    """Refuse an output that is `source`, contains it or lies inside it (resolved paths)."""
    if source is None:
        return
    target, src = out.expanduser().resolve(), source.expanduser().resolve()
    if target == src:
        raise MtpkitError(f"{option} {out} is the source itself: write the output elsewhere")
    if src.is_relative_to(target):
        raise MtpkitError(
            f"{option} {out} contains the source {source}: replacing it would delete the "
            "source (with or without --force); write the output elsewhere"
        )
    if target.is_relative_to(src):
        raise MtpkitError(
            f"{option} {out} lies inside the source {source}: write the output outside it"
        )


def temp_sibling(path: Path, mark: str = TEMP_MARK) -> Path:
    """This process's hidden sibling of `path` (`.NAME.mtpkit-tmp-PID`)."""
    return path.parent / f".{path.name}.{mark}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """True while a process `pid` exists (one of another user counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def stale_siblings(paths: Iterable[Path]) -> list[Path]:
    """The temporary siblings of `paths` left by runs whose process is gone."""
    found = []
    for path in paths:
        parent = path.parent
        if not parent.is_dir():
            continue
        for entry in sorted(parent.iterdir()):
            match = SIBLING.match(entry.name)
            if match and match["name"] == path.name and not pid_alive(int(match["pid"])):
                found.append(entry)
    return found


def remove_stale(paths: Iterable[Path], log: Callable[[str], None] | None = None) -> list[Path]:
    """Remove the siblings `stale_siblings` finds, with one line each through `log`."""
    if log is None:
        from mtpkit.core.console import log
    removed = stale_siblings(paths)
    for entry in removed:
        log(f"removing {entry}, left by an earlier run that did not finish")
        _remove(entry)
    return removed


def work_dir_prefix(stem: str) -> str:
    """The prefix of this process's scratch directories (`STEM-PID-`), for `tempfile`."""
    return f"{stem}-{os.getpid()}-"


def remove_stale_work_dirs(
    root: Path, stem: str, log: Callable[[str], None] | None = None
) -> list[Path]:
    """Remove the `STEM-PID-*` scratch directories under `root` of runs whose process is
    gone (a killed `check` leaves a converted model there), with one line each."""
    if log is None:
        from mtpkit.core.console import log
    pattern = re.compile(rf"^{re.escape(stem)}-(?P<pid>\d+)-")
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        match = pattern.match(entry.name)
        if match and entry.is_dir() and not pid_alive(int(match["pid"])):
            log(f"removing {entry}, left by an earlier run that did not finish")
            _remove(entry)
            removed.append(entry)
    return removed


def fresh_temp_dir(out: Path) -> Path:
    """An empty temporary directory beside `out`, named after this process."""
    tmp = temp_sibling(out)
    try:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise MtpkitError(f"cannot write {out}: {e.strerror or e}") from None
    return tmp


def replace_with(out: Path, tmp: Path) -> None:
    """Move the finished `tmp` to `out`, removing what was there only once it is moved."""
    if not out.exists() and not out.is_symlink():
        tmp.rename(out)
        return
    old = temp_sibling(out, OLD_MARK)
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    _remove(old)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


class FileSwap:
    """Several files written beside their targets and moved over them at the end.

    On any failure before `commit`, the temporaries are removed and a directory this swap
    created is removed again, so the directory is left as it was.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pending: list[tuple[Path, Path]] = []
        self.created: list[Path] = []

    def temp_for(self, target: Path) -> Path:
        """Where to write `target`'s new content (its parent made if missing)."""
        missing = []
        parent = target.parent
        while not parent.exists() and parent != parent.parent:
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            directory.mkdir()
            self.created.append(directory)
        tmp = temp_sibling(target)
        self.pending.append((tmp, target))
        return tmp

    def commit(self) -> None:
        for tmp, target in self.pending:
            os.replace(tmp, target)
        self.pending = []

    def abort(self) -> None:
        for tmp, _ in self.pending:
            _remove(tmp)
        for directory in reversed(self.created):
            try:
                directory.rmdir()
            except OSError:
                pass
        self.pending = []


__all__ = [
    "FileSwap",
    "fresh_temp_dir",
    "local_source_dir",
    "pid_alive",
    "refuse_overlap",
    "remove_stale",
    "remove_stale_work_dirs",
    "replace_with",
    "stale_siblings",
    "temp_sibling",
    "work_dir_prefix",
]
