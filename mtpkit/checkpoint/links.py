"""Which links in a directory mtpkit follows when it copies or publishes a file.

A file that is copied into an output (the tokenizer and the other side files) or published
(`--upload-repo`, `mtpkit upload`) may be a link only to a place inside its directory, or, in
the Hugging Face cache, from a snapshot (`models--ORG--NAME/snapshots/REV/FILE`) into that
repo's `blobs/`, which is how the cache stores every file. Any other link
(`vocab.txt -> ~/.cache/huggingface/token`, `tokenizer.json -> /etc/shadow`) is refused: its
data is not the checkpoint's, and copying it would carry it into the output and onto the Hub.
What a side file claims to be is checked too: a `.json` file parses as JSON, a text file
(vocabulary, merges, template, code) decodes as UTF-8.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtpkit.core.errors import NotACheckpoint

# Side files read as text; a `.json` one must also parse.
TEXT_SUFFIXES = (".json", ".txt", ".jinja", ".py", ".tiktoken")


class LinkOutsideSource(NotACheckpoint):
    """A file of a directory is a link to data outside it."""


def hf_cache_blobs(root: Path) -> Path | None:
    """The `blobs/` folder a Hugging Face cache snapshot's links lead into, or None when
    `root` is not a snapshot (`.../models--ORG--NAME/snapshots/REV`)."""
    snapshots = root.parent
    repo = snapshots.parent
    if snapshots.name != "snapshots" or not repo.name.startswith(("models--", "datasets--")):
        return None
    return repo / "blobs"


def escaping_target(root: Path, name: str) -> Path | None:
    """Where `root/name` really is when a link takes it outside `root` (and outside the
    cache's blobs for a snapshot); None when the file stays where it may."""
    real = (root / name).resolve()
    if real.is_relative_to(root.resolve()):
        return None
    blobs = hf_cache_blobs(root.absolute())
    if blobs is not None and real.is_relative_to(blobs.resolve()):
        return None
    return real


def contained_file(root: Path, name: str, *, what: str) -> Path:
    """`root/name`, refused (`LinkOutsideSource`) when a link carries it out of `root`;
    `what` names the directory in the message ("the source", "the output")."""
    real = escaping_target(root, name)
    if real is not None:
        raise LinkOutsideSource(
            f"{root / name} is a link to {real}, outside {what} {root}: mtpkit copies and "
            "publishes no file from outside it; replace the link with the file itself"
        )
    return root / name


def checked_side_file(root: Path, name: str) -> Path:
    """A side file to copy into an output: inside the source, and what its name says."""
    path = contained_file(root, name, what="the source")
    if not path.name.endswith(TEXT_SUFFIXES) and path.name not in ("vocab", "merges"):
        return path  # a binary tokenizer model (SentencePiece, tiktoken.model)
    try:
        text = path.read_bytes().decode("utf-8")
        if path.name.endswith(".json"):
            json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        kind = "JSON" if path.name.endswith(".json") else "UTF-8 text"
        raise NotACheckpoint(
            f"{path} is not {kind} as its name says ({type(e).__name__}): mtpkit copies no "
            "side file that is not what it claims to be; restore it from the original"
        ) from None
    return path


__all__ = ["LinkOutsideSource", "checked_side_file", "contained_file", "escaping_target"]
