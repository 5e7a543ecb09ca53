"""`mtpkit convert ... --upload-repo org/name`: a checked conversion published in one commit.

The conversion is checked first (`mtpkit check`; a failing verdict is never uploaded), its model
card written into it (`card.py`), then every file goes up in ONE commit that also deletes what
the repo held before: the Hub applies a commit whole or not at all, so an upload that fails half
way publishes nothing (huggingface_hub's `upload_folder` may split a large folder into several
commits when hf_xet is installed, which is why it is not used here).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtpkit import __version__
from mtpkit.core.errors import MtpkitError
from mtpkit.core.manifest import MANIFEST_PATH
from mtpkit.publish.card import model_card

CARD = "README.md"


def checked(output: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """`mtpkit check` on the local conversion; a failing verdict stops the upload."""
    from mtpkit.check.verdict import check_checkpoint

    result = check_checkpoint(str(output), log=log)
    if result["verdict"] != "pass":
        failed = next(c for c in result["checks"] if c["status"] == "fail")
        raise MtpkitError(
            f"{output} fails `mtpkit check` ({failed['name']}: {failed['detail']}); nothing was "
            "uploaded"
        )
    return result


def upload(
    output: str | Path,
    repo_id: str,
    *,
    check: bool = True,
    private: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Check `output`, write its model card, and publish it as `repo_id` in one commit.

    Returns `{repo, commit, url, check}`; raises `MtpkitError` naming what failed, with the
    conversion left in `output`.
    """
    import json

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    say = log or (lambda message: None)
    output = Path(output)
    manifest_path = output / MANIFEST_PATH
    if not manifest_path.is_file():
        raise MtpkitError(f"{output} has no {MANIFEST_PATH}: only an mtpkit conversion is uploaded")
    manifest = json.loads(manifest_path.read_text())
    result = checked(output, say) if check else None
    (output / CARD).write_text(model_card(repo_id, manifest, result))
    files = sorted(
        p.relative_to(output).as_posix()
        for p in output.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(output).parts)
    )
    api = HfApi()
    try:
        say(f"uploading {len(files)} files to {repo_id}")
        api.create_repo(repo_id, exist_ok=True, private=private)
        stale = [
            p for p in api.list_repo_files(repo_id) if p not in files and p != ".gitattributes"
        ]
        operations: list[Any] = [CommitOperationDelete(p) for p in stale]
        operations += [CommitOperationAdd(p, str(output / p)) for p in files]
        source = (manifest.get("source") or {}).get("spec")
        info = api.create_commit(
            repo_id,
            operations,
            commit_message=f"mtpkit {__version__}: {source} converted with its MTP head",
        )
    except Exception as e:  # noqa: BLE001 - any failure of the client is the user's to see
        raise MtpkitError(
            f"uploading {output} to {repo_id} failed, nothing was published ({_reason(e)}); "
            f"the conversion stays in {output}: run the command again to retry"
        ) from None
    return {"repo": repo_id, "commit": info.oid, "url": info.commit_url, "check": result}


def _reason(error: BaseException) -> str:
    """The client's error in one line, with the error behind a wrapper (an LFS upload's
    RuntimeError wraps the HTTP error that says why)."""
    cause = error.__cause__ if isinstance(error, RuntimeError) and error.__cause__ else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__
