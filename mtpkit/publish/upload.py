"""`mtpkit upload DIR --upload-repo org/name` and `convert --upload-repo`: a checked
conversion published in one commit, never at the cost of what the repo held.

- Before anything else (`preflight`; before a conversion, not after): a token that may
  write, a repo that is not the conversion's source, and a repo that is new or holds nothing
  but `.gitattributes`. A repo that holds files is replaced only when asked (`replace`,
  `--replace-repo`), and only if it holds a model or an earlier mtpkit upload, as `--force`
  replaces a local output.
- The conversion is checked (`mtpkit check`; a failing verdict is never uploaded), its model
  card written into it (`card.py`), and every file goes up in ONE commit whose parent is the
  commit the preflight saw: a repo changed since is refused by the Hub, so nothing unseen is
  deleted. Files the repo held are deleted only when replacing it. The Hub applies a commit
  whole or not at all (huggingface_hub's `upload_folder` may split a large folder into
  several commits when hf_xet is installed, which is why it is not used here).
- A failed upload publishes nothing, an empty repo this run created is deleted again (also
  when a signal ends the run), and the message names the command that retries
  (`mtpkit upload DIR --upload-repo R`).
- Every request is bounded in time and a signal ends the run at once (`hub.py`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpkit import __version__
from mtpkit.checkpoint.links import contained_file
from mtpkit.checkpoint.source import source_repo
from mtpkit.core.errors import MtpkitError
from mtpkit.core.manifest import MANIFEST_PATH
from mtpkit.publish.card import is_mtpkit_card, model_card
from mtpkit.publish.hub import bounded_requests, on_the_hub

CARD = "README.md"
# What a repo the Hub just created holds: such a repo counts as empty.
EMPTY_REPO_FILES = frozenset({".gitattributes"})
WEIGHT_FILE = re.compile(r"^[^/]*\.(safetensors|gguf|bin|npz)$")
# Seconds the deletion of a repo an interrupted upload created may take (the run is ending).
CLEANUP_TIMEOUT = 10.0
Log = Callable[[str], None]


class UploadError(MtpkitError):
    """An upload that cannot be done, or failed with nothing published."""


@dataclass(frozen=True)
class RepoState:
    """What the preflight saw of the repo: whether it exists, its commit and its files."""

    repo_id: str
    exists: bool
    commit: str | None = None
    files: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- preflight


def preflight(
    repo_id: str, *, source: str | None = None, replace: bool = False, quiet: bool = False
) -> RepoState:
    """Everything refused about publishing to `repo_id`, before any work: the source itself,
    a token that cannot write, a repo holding files (unless `replace`)."""
    refuse_source(repo_id, source)
    return on_the_hub(lambda: _repo_state(repo_id, replace), quiet=quiet)


def refuse_source(repo_id: str, source: str | None) -> None:
    """An upload never replaces the checkpoint it was converted from (as a local output
    never replaces its source, `--force` or not)."""
    origin = source_repo(source)
    if origin is not None and origin.lower() == repo_id.lower():
        raise UploadError(
            f"--upload-repo {repo_id} is the source {source} itself: publishing there would "
            "replace the original checkpoint; choose another --upload-repo"
        )


def _repo_state(repo_id: str, replace: bool) -> RepoState:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    api = HfApi()
    _token_may_write(api)
    try:
        info = api.model_info(repo_id)
    except RepositoryNotFoundError:
        return RepoState(repo_id, exists=False)
    except Exception as e:  # noqa: BLE001 - the client's failure, named in one line
        raise UploadError(f"cannot read the Hub repo {repo_id}: {reason(e)}") from None
    files = sorted(s.rfilename for s in info.siblings or [])
    held = [f for f in files if f not in EMPTY_REPO_FILES]
    if held and not replace:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise UploadError(
            f"{repo_id} already holds {len(held)} files ({shown}): pass --replace-repo to "
            "replace them, or choose another --upload-repo"
        )
    if held and not _replaceable(files):
        raise UploadError(
            f"{repo_id} --replace-repo: it holds no model (config.json beside weights) and no "
            "earlier mtpkit upload; --replace-repo replaces only those: choose another "
            "--upload-repo"
        )
    return RepoState(repo_id, exists=True, commit=info.sha, files=files)


def _replaceable(files: list[str]) -> bool:
    """A repo `--replace-repo` may replace: a model or an earlier mtpkit upload."""
    if MANIFEST_PATH in files:
        return True
    return "config.json" in files and any(WEIGHT_FILE.match(f) for f in files)


def _token_may_write(api: Any) -> None:
    from huggingface_hub import get_token
    from huggingface_hub.errors import HfHubHTTPError

    login = "log in with `hf auth login` (a token that may write) or set HF_TOKEN"
    if get_token() is None:
        raise UploadError(f"no Hugging Face token to upload with: {login}")
    try:
        who = api.whoami()
    except HfHubHTTPError as e:
        if e.response is not None and e.response.status_code == 401:
            raise UploadError(f"the Hugging Face token is not valid (401): {login}") from None
        raise UploadError(f"cannot reach the Hub to check the token: {reason(e)}") from None
    except Exception as e:  # noqa: BLE001 - a network failure, named in one line
        raise UploadError(f"cannot reach the Hub to check the token: {reason(e)}") from None
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise UploadError(f"the Hugging Face token is read-only: {login}")


# --------------------------------------------------------------------------- upload


def checked(output: Path, log: Log) -> dict[str, Any]:
    """`mtpkit check` on the local conversion; a failing verdict stops the upload."""
    from mtpkit.check.verdict import check_checkpoint

    result = check_checkpoint(str(output), log=log)
    if result["verdict"] != "pass":
        failed = next(c for c in result["checks"] if c["status"] == "fail")
        raise UploadError(
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
    replace: bool = False,
    state: RepoState | None = None,
    quiet: bool = False,
    log: Log | None = None,
) -> dict[str, Any]:
    """Check `output`, write its model card, and publish it as `repo_id` in one commit.

    `state` is what `preflight` returned (run here when not given). Returns `{repo, commit,
    url, check}`; raises `UploadError` naming what failed, with the conversion left in
    `output`.
    """
    say = log or (lambda message: None)
    output = Path(output)
    manifest = _manifest(output)
    record = manifest.get("source")
    source = record.get("spec") if isinstance(record, dict) else None
    refuse_source(repo_id, source)
    published_files(output)  # before the check's minutes: a link out of `output` is refused
    if state is None:
        state = preflight(repo_id, replace=replace, quiet=quiet)
    result = checked(output, say) if check else None
    _write_card(output / CARD, model_card(repo_id, manifest, result), say)
    files = published_files(output)
    say(f"uploading {len(files)} files to {repo_id}")
    retry = f"mtpkit upload {output} --upload-repo {repo_id}" + (
        " --replace-repo" if replace else ""
    )
    message = f"mtpkit {__version__}: {source} converted with its MTP head"
    created: list[str] = []  # the repo, once this run has created it
    try:
        info = on_the_hub(
            lambda: _publish(output, files, state, private, replace, message, retry, created),
            quiet=quiet,
        )
    except KeyboardInterrupt:  # a signal: an interrupted upload leaves no repo it created
        if created:
            from huggingface_hub import HfApi

            with bounded_requests(CLEANUP_TIMEOUT):
                if not _deleted(HfApi(), repo_id):
                    say(f"the repo {repo_id} this run created is left on the Hub (it did not "
                        "answer its deletion): delete it there")  # fmt: skip
        raise
    if isinstance(info, LandedCommit):
        say(f"the Hub did not answer the commit, but {repo_id} holds it: published")
    return {"repo": repo_id, "commit": info.oid, "url": info.commit_url, "check": result}


def _write_card(path: Path, card: str, say: Log) -> None:
    """mtpkit's model card as `path`, unless `path` is a README.md of the user's own (not
    one an earlier upload wrote): that one is published as it is, and never overwritten."""
    if path.is_file() and not is_mtpkit_card(path.read_text(encoding="utf-8", errors="replace")):
        say(f"{path} is your own: it is uploaded as the model card, unchanged (move it away "
            "to have mtpkit write its card)")  # fmt: skip
        return
    path.write_text(card, encoding="utf-8")


def _manifest(output: Path) -> dict[str, Any]:
    """The conversion's manifest: only an mtpkit conversion is uploaded."""
    if not output.is_dir():
        raise UploadError(f"no such directory {output}: pass the directory `mtpkit convert` wrote")
    path = output / MANIFEST_PATH
    if not path.is_file():
        raise UploadError(f"{output} has no {MANIFEST_PATH}: only an mtpkit conversion is uploaded")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise UploadError(f"{path} is not valid JSON ({type(e).__name__}): convert again") from None
    if not isinstance(manifest, dict):
        raise UploadError(f"{path} is not a manifest (not a JSON object): convert again")
    return manifest


def published_files(output: Path) -> list[str]:
    """The files an upload publishes (hidden ones left out); a link out of `output` is
    refused (`mtpkit.checkpoint.links`)."""
    files = []
    for path in sorted(output.rglob("*")):
        rel = path.relative_to(output)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        contained_file(output, rel.as_posix(), what="the output")
        files.append(rel.as_posix())
    return files


def _publish(
    output: Path,
    files: list[str],
    state: RepoState,
    private: bool | None,
    replace: bool,
    message: str,
    retry: str,
    created_repo: list[str],
) -> Any:
    """The one commit (and the repo, when new); on failure, a repo this run created is
    deleted again and the error says how to retry."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    api = HfApi()
    repo_id = state.repo_id
    created = False
    try:
        if not state.exists:
            api.create_repo(repo_id, private=private)
            created = True
            created_repo.append(repo_id)
        stale = [p for p in state.files if p not in files and p not in EMPTY_REPO_FILES]
        operations: list[Any] = [CommitOperationDelete(p) for p in stale] if replace else []
        operations += [CommitOperationAdd(p, str(output / p)) for p in files]
        try:
            return api.create_commit(
                repo_id, operations, commit_message=message, parent_commit=state.commit
            )
        except Exception as e:
            if not _unanswered(e):
                raise
            return _landed_anyway(api, state, files, output, retry, e)
    except UploadError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the client is the user's to see
        left = ""
        if created:
            left = (
                f"; the empty repo {repo_id} this run created was deleted"
                if _deleted(api, repo_id)
                else f"; the repo {repo_id} this run created is empty (delete it on the Hub)"
            )
        raise UploadError(
            f"uploading {output} to {repo_id} failed, nothing was published ({reason(e)})"
            f"{left}; the conversion stays in {output}: retry with `{retry}`"
        ) from None


@dataclass(frozen=True)
class LandedCommit:
    """A commit the Hub applied though its answer never came (`CommitInfo`'s two fields
    that `upload` reads)."""

    oid: str
    commit_url: str


def _unanswered(error: BaseException) -> bool:
    """Whether a request failed without an answer (a timeout, a dropped connection): the
    Hub may have applied it. By the class's name: huggingface_hub 2.x raises httpx2's
    errors, 1.x httpx's, of one hierarchy."""
    names = {cls.__name__ for cls in type(error).__mro__}
    return "TransportError" in names or isinstance(error, (TimeoutError, ConnectionError))


def _landed_anyway(
    api: Any, state: RepoState, files: list[str], output: Path, retry: str, error: Exception
) -> LandedCommit:
    """The commit whose answer never came, if the repo shows it applied: its head moved
    past the commit the preflight saw and it holds every file uploaded. Otherwise the
    `error` (nothing published, `_publish` says so); where the repo cannot be read, an
    error that says the commit may have been published, leaving the repo as it is."""
    repo_id = state.repo_id
    try:
        info = api.model_info(repo_id)
    except Exception as e:  # noqa: BLE001 - the Hub is still silent: nothing is known
        raise UploadError(
            f"uploading {output} to {repo_id}: the Hub did not answer the commit "
            f"({reason(error)}) nor then ({reason(e)}), and may have applied it: look at "
            f"{api.endpoint}/{repo_id} before you retry with `{retry}` (the conversion stays "
            f"in {output})"
        ) from None
    held = {s.rfilename for s in info.siblings or []}
    if info.sha is None or info.sha == state.commit or not set(files) <= held:
        raise error
    return LandedCommit(info.sha, f"{api.endpoint}/{repo_id}/commit/{info.sha}")


def _deleted(api: Any, repo_id: str) -> bool:
    try:
        api.delete_repo(repo_id, missing_ok=True)
    except Exception:  # noqa: BLE001 - the message then says the repo is left
        return False
    return True


def reason(error: BaseException) -> str:
    """The client's error in one line, with the error behind a wrapper (an LFS upload's
    RuntimeError wraps the HTTP error that says why)."""
    cause = error.__cause__ if isinstance(error, RuntimeError) and error.__cause__ else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


__all__ = ["RepoState", "UploadError", "preflight", "published_files", "refuse_source", "upload"]
