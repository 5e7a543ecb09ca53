"""`mtpkit upload`: publish an existing conversion (mlx_lm.upload's `--path`/`--upload-repo`)."""

from __future__ import annotations

from typing import Annotated

import typer

from mtpkit.cli.options import JsonOpt, QuietOpt, friendly_errors
from mtpkit.publish.card import HUB_REPO

DirArg = Annotated[
    str | None,
    typer.Argument(
        metavar="DIR", help="The converted MLX directory to publish.", show_default=False
    ),
]
PathOpt = Annotated[
    str | None,
    typer.Option("--path", metavar="DIR", help="The same as DIR (mlx_lm.upload's spelling)."),
]
RepoOpt = Annotated[
    str | None,
    typer.Option("--upload-repo", "--repo", metavar="ORG/NAME", help="The Hub repo to publish to."),
]
ReplaceRepoOpt = Annotated[
    bool,
    typer.Option(
        "--replace-repo",
        help="Replace the files a repo already holds (a model or an earlier mtpkit upload "
        "only; its history stays on the Hub). Without it a repo that holds files is refused.",
    ),
]
PrivateOpt = Annotated[bool, typer.Option("--private", help="Create the repo private.")]
NoCheckOpt = Annotated[
    bool,
    typer.Option("--no-check", help="Skip `mtpkit check` before publishing (not recommended)."),
]


@friendly_errors
def upload_command(
    ctx: typer.Context,
    directory: DirArg = None,
    path: PathOpt = None,
    upload_repo: RepoOpt = None,
    replace_repo: ReplaceRepoOpt = False,
    private: PrivateOpt = False,
    no_check: NoCheckOpt = False,
    quiet: QuietOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Publish a conversion made by `mtpkit convert` (or `train-head`) as a Hub repo: checked
    by `mtpkit check`, with a model card, in one commit. The token and the repo are checked
    first; a repo that holds files is refused unless --replace-repo is given, and nothing is
    ever published to the repo the conversion came from. This is also how a failed
    `convert --upload-repo` is retried."""
    from mtpkit.cli.output import print_json
    from mtpkit.core.console import log
    from mtpkit.publish.upload import upload

    if directory is not None and path is not None and directory != path:
        ctx.fail("pass the directory once: DIR or --path DIR")
    directory = directory or path
    if directory is None:
        ctx.fail("Missing argument 'DIR' (or --path DIR).")
    if upload_repo is None:
        ctx.fail("Missing option '--upload-repo' ORG/NAME.")
    if not HUB_REPO.match(upload_repo):
        raise typer.BadParameter(f"{upload_repo!r} is not a Hub repo id (org/name)")
    published = upload(
        directory,
        upload_repo,
        check=not no_check,
        private=private or None,
        replace=replace_repo,
        quiet=quiet or json_output,
        log=lambda line: log(f"... {line}"),
    )
    if json_output:
        print_json(published)
        return
    print(published_line(published), flush=True)


def published_line(published: dict) -> str:
    """`published org/name at COMMIT, check pass, acceptance X%` (stdout)."""
    acceptance = (published["check"] or {}).get("acceptance")
    checked = f", check pass, acceptance {acceptance:.1%}" if acceptance is not None else ""
    return f"published {published['repo']} at {published['commit'][:12]}{checked}"
