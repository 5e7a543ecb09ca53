"""Where mtpkit writes, and how, so that nothing it reads or did not make is ever lost.

One module serves every command that writes: `convert` and `train-head -o` (a new model
directory), a graft and `train-head --into` (files swapped into an existing one), and
`check --junit` (one report file).

- Overlap: an output that is the source, contains it or lies inside it is refused, `--force`
  or not, and so is one that holds any FILE of the source wherever its link points (a
  Hugging Face cache snapshot links every file into `blobs/`).
- `--force` replaces only what is recognisably a model directory (config.json beside
  safetensors weights), an earlier mtpkit output (`mtp/manifest.json`) or an empty directory;
  anything else (a photo folder, a folder of models, a file) is refused with the reason.
- Nothing is written through a link that leaves the output (a symlinked `mtp/` of a model
  directory may point into another model).
- Everything is written into a temporary sibling `.NAME.mtpkit-tmp-PID` and renamed over the
  target at the end. An interrupted run removes its sibling; one killed outright (SIGKILL,
  power loss) leaves it behind, and the next run that writes there removes the siblings of
  runs whose process is gone, and says so. A run killed between its two final renames leaves
  the previous output as `.NAME.mtpkit-old-PID`: the next run puts it back before anything
  else, so an old output is kept until a new one is in place.
- The final rename judges the output again (`--force` and what it may replace), and a lock
  beside the output (`mtpkit.core.lock`) keeps a second run from writing it meanwhile.
- A report file (`check --junit`) replaces only a regular file; a FIFO, a device or
  `/dev/stdout` gets the text as a stream (`mtpkit.core.files`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mtpkit.core.errors import MtpkitError
from mtpkit.core.files import own_descriptor, write_text_file
from mtpkit.core.lock import exclusive_output
from mtpkit.core.signals import deferred

TEMP_MARK = "mtpkit-tmp"
OLD_MARK = "mtpkit-old"
# `.NAME.mtpkit-tmp-PID` (work in progress) or `.NAME.mtpkit-old-PID` (a replaced output).
SIBLING = re.compile(rf"^\.(?P<name>.+)\.(?P<mark>{TEMP_MARK}|{OLD_MARK})-(?P<pid>\d+)$")
# What makes a directory recognisably a model directory (with config.json).
WEIGHT_FILE = re.compile(r".*\.(safetensors|safetensors\.index\.json|gguf|bin|npz)$")
EARLIER_OUTPUT = "mtp/manifest.json"
# A checkpoint holds a few dozen files; the overlap walk stops well past that.
MAX_SOURCE_ENTRIES = 100_000
Log = Callable[[str], None]


class DestinationError(MtpkitError):
    """An output mtpkit refuses to write: it would lose data that is not its own."""


def local_source_dir(spec: str) -> Path | None:
    """The directory a source spec names on this machine (as `open_source` decides), or None."""
    path = Path(spec).expanduser()
    return path if path.is_dir() else None


# --------------------------------------------------------------------------- overlap


def _resolved(path: Path) -> Path:
    return path.expanduser().resolve()


def _source_links(source: Path) -> Iterator[tuple[Path, Path]]:
    """(entry, where it really is) for every linked file or directory of a checkpoint
    `source` (one with config.json; a directory such as /usr is never walked)."""
    if not (source / "config.json").is_file():
        return
    seen = 0
    for root, dirs, files in os.walk(source):
        for name in files + dirs:
            seen += 1
            entry = Path(root) / name
            if entry.is_symlink():
                yield entry, entry.resolve()
        if seen > MAX_SOURCE_ENTRIES:
            return


def refuse_overlap(out: Path, source: Path | None, *, option: str = "-o") -> None:
    """Refuse an output that is `source`, contains it, lies inside it, or holds any file of
    it through a link (resolved paths)."""
    if source is None:
        return
    target, src = _resolved(out), _resolved(source)
    if target == src:
        raise DestinationError(f"{option} {out} is the source itself: write the output elsewhere")
    if src.is_relative_to(target):
        raise DestinationError(
            f"{option} {out} contains the source {source}: replacing it would delete the "
            "source (with or without --force); write the output elsewhere"
        )
    if target.is_relative_to(src):
        raise DestinationError(
            f"{option} {out} lies inside the source {source}: write the output outside it"
        )
    if not src.is_dir():
        return
    for entry, real in _source_links(src):
        if real.is_relative_to(target) or (real.is_dir() and target.is_relative_to(real)):
            raise DestinationError(
                f"{option} {out} holds {real}, the file the source's {entry.name} links to: "
                "replacing it would delete the source's data (with or without --force); "
                "write the output elsewhere"
            )


def refuse_inside(path: Path, sources: Iterable[Path | None], *, option: str) -> None:
    """Refuse a file output that is a source file or lies inside a source directory."""
    target = _resolved(path)
    for source in sources:
        if source is None:
            continue
        src = _resolved(source)
        if target == src or target.is_relative_to(src):
            raise DestinationError(
                f"{option} {path} lies inside the source {source}: write it outside the source"
            )
        for entry, real in _source_links(src) if src.is_dir() else ():
            if real == target:
                raise DestinationError(
                    f"{option} {path} is {entry}'s data (a link of the source): write it "
                    "outside the source"
                )


def refuse_link_out(root: Path, target: Path, *, option: str) -> None:
    """Refuse to write `target` where a link inside `root` would carry it out of `root`."""
    real_root = _resolved(root)
    real_parent = _resolved(target.parent)
    if not real_parent.is_relative_to(real_root):
        link = next(
            (p for p in [target.parent, *target.parent.parents] if p.is_symlink()), target.parent
        )
        raise DestinationError(
            f"{option} {root}: {link.relative_to(root)} is a link to {link.resolve()}, outside "
            f"{root}; mtpkit writes nothing through it: replace the link with a directory"
        )


# --------------------------------------------------------------------------- --force


def why_not_replaceable(out: Path) -> str | None:
    """Why `--force` may not replace `out` (None: it may): only a model directory, an earlier
    mtpkit output or an empty directory is replaced (a link is replaced, never followed)."""
    if out.is_symlink() or not out.exists():
        return None
    if not out.is_dir():
        return "it is a file, not a model directory"
    entries = sorted(out.iterdir())
    if not entries or (out / EARLIER_OUTPUT).is_file():
        return None
    nested = [e.name for e in entries if e.is_dir() and (e / "config.json").is_file()]
    if nested:
        return f"it holds other models ({', '.join(nested[:3])})"
    weights = [e for e in entries if WEIGHT_FILE.match(e.name)]
    if (out / "config.json").is_file() and weights:
        return None
    shown = ", ".join(e.name for e in entries[:3]) + (", ..." if len(entries) > 3 else "")
    return f"it is not a model directory or an earlier mtpkit output (it holds {shown})"


def claim_output(
    out: Path,
    *,
    force: bool,
    sources: Iterable[Path | None] = (),
    option: str = "-o",
    log: Log | None = None,
) -> None:
    """Everything refused about a new output directory, before any work is done; an output
    a killed run left aside (`mtpkit-old`) is put back first, so it counts as existing."""
    for source in sources:
        refuse_overlap(out, source, option=option)
    remove_stale([out], log)
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise DestinationError(
            f"{out} already exists: pass --force to replace it, or choose another {option}"
        )
    why = why_not_replaceable(out)
    if why is not None:
        raise DestinationError(
            f"{option} {out} --force: {why}; --force replaces only a model directory, an "
            "earlier mtpkit output or an empty directory: remove it yourself or choose "
            f"another {option}"
        )


# --------------------------------------------------------------------------- siblings


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


def remove_stale(paths: Iterable[Path], log: Log | None = None) -> list[Path]:
    """Clean up after runs killed outright: a replaced output (`mtpkit-old`) whose target is
    missing is put back, every other sibling of a dead run is removed; one line each."""
    if log is None:
        from mtpkit.core.console import log
    removed = []
    for entry in stale_siblings(paths):
        match = SIBLING.match(entry.name)
        target = entry.parent / match["name"]
        if match["mark"] == OLD_MARK and not (target.exists() or target.is_symlink()):
            log(f"restoring {target} from {entry}, left by a run killed while replacing it")
            entry.rename(target)
            continue
        log(f"removing {entry}, left by an earlier run that did not finish")
        _remove(entry)
        removed.append(entry)
    return removed


def work_dir_prefix(stem: str) -> str:
    """The prefix of this process's scratch directories (`STEM-PID-`), for `tempfile`."""
    return f"{stem}-{os.getpid()}-"


def remove_stale_work_dirs(root: Path, stem: str, log: Log | None = None) -> list[Path]:
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


# --------------------------------------------------------------------------- writing


def fresh_temp_dir(out: Path) -> Path:
    """An empty temporary directory beside `out`, named after this process (mode 0755
    under the usual umask, as `mkdir` makes it)."""
    tmp = temp_sibling(out)
    try:
        if tmp.exists() or tmp.is_symlink():
            _remove(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise MtpkitError(f"cannot write {out}: {e.strerror or e}") from None
    return tmp


def replace_with(out: Path, tmp: Path, *, force: bool = True, option: str = "-o") -> None:
    """Move the finished `tmp` to `out`, removing what was there only once it is moved.

    What is at `out` now is judged again (`--force` and what it may replace): another run,
    or a user in another terminal, may have made it since the run began."""
    if not out.exists() and not out.is_symlink():
        tmp.rename(out)
        return
    if not force:
        raise DestinationError(
            f"{out} appeared while this run was writing it (another run or program made it): "
            f"nothing was replaced; pass --force to replace it, or choose another {option}"
        )
    why = why_not_replaceable(out)
    if why is not None:
        raise DestinationError(
            f"{option} {out} --force: {why} (it changed while this run was writing); nothing "
            "was replaced"
        )
    old = temp_sibling(out, OLD_MARK)
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    _remove(old)


@contextmanager
def new_directory(
    out: Path, *, force: bool = True, option: str = "-o", log: Log | None = None
) -> Iterator[Path]:
    """A temporary sibling of `out` to write into; renamed over `out` when the block ends
    without an error (if `out` may still be replaced: `replace_with`), removed on any error
    or interrupt (then `out` is as it was). The output is locked meanwhile."""
    with exclusive_output(out, option=option):
        remove_stale([out], log)  # a killed run's work; its replaced output is already back
        tmp = fresh_temp_dir(out)
        try:
            yield tmp
            replace_with(out, tmp, force=force, option=option)
        except OSError as e:
            _remove(tmp)
            raise MtpkitError(f"writing {out} failed, nothing was written: {_reason(e)}") from None
        except BaseException:
            _remove(tmp)
            raise


def write_file(path: Path, text: str, *, option: str, sources: Iterable[Path | None] = ()) -> None:
    """Write one file (a report), never inside a source: a regular file is replaced
    atomically, a link to one is replaced rather than followed, and a FIFO, a device or
    `/dev/stdout` receives the text as a stream (`mtpkit.core.files`)."""
    path = Path(path).expanduser()
    if own_descriptor(path) is None:
        refuse_inside(path, sources, option=option)
    write_text_file(path, text, option=option)


def _reason(e: OSError) -> str:
    return f"{e.strerror} ({e.filename})" if e.strerror and e.filename else str(e.strerror or e)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


class FileSwap:
    """Several files written beside their targets inside `root` and moved over them at the
    end; nothing is written through a link that leaves `root`.

    On any failure before `commit`, the temporaries are removed and a directory this swap
    created is removed again, so the directory is left as it was.
    """

    def __init__(self, root: Path, *, option: str = "--into") -> None:
        self.root = root
        self.option = option
        self.pending: list[tuple[Path, Path]] = []
        self.created: list[Path] = []

    def check(self, targets: Iterable[Path]) -> None:
        """Refuse, before any work, targets a link would carry out of `root`."""
        for target in targets:
            parent = target.parent
            while not parent.exists() and not parent.is_symlink() and parent != self.root:
                parent = parent.parent
            refuse_link_out(self.root, parent / "x", option=self.option)

    def temp_for(self, target: Path) -> Path:
        """Where to write `target`'s new content (its parent made if missing)."""
        self.check([target])
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
        """Move every file over its target; a signal waits until all are moved, so the
        directory never holds part of the new files (only a crash of the machine could)."""
        with deferred():
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
    "DestinationError",
    "exclusive_output",
    "FileSwap",
    "claim_output",
    "fresh_temp_dir",
    "local_source_dir",
    "new_directory",
    "pid_alive",
    "refuse_inside",
    "refuse_link_out",
    "refuse_overlap",
    "remove_stale",
    "remove_stale_work_dirs",
    "replace_with",
    "stale_siblings",
    "temp_sibling",
    "why_not_replaceable",
    "work_dir_prefix",
    "write_file",
]
