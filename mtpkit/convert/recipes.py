"""Conversion recipes: `recipes/*.toml`, one per published model, with the reasons.

A recipe holds the settings `mtpkit convert` takes as flags, under `[convert]`, and names
the model under `[model]`. Flags given on the command line override the recipe.

    [model]
    repo = "Qwen/Qwen3.5-27B"
    family = "qwen3_5"

    [convert]
    bits = 4
    group_size = 64
    keep_mtp_bf16 = true
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mtpkit.core.errors import MtpkitError

RECIPE_KEYS = {
    "quantize",
    "bits",
    "group_size",
    "mode",
    "quant_predicate",
    "keep_mtp_bf16",
    "mtp_bits",
    "dtype",
    "layout",
    "hidden",
}
# Shipped as package data (a wheel has them too); `recipes/` at the top of a checkout is a
# link to this folder.
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass
class Recipe:
    path: Path
    repo: str | None
    family: str | None
    settings: dict[str, Any] = field(default_factory=dict)


def recipe_names() -> list[str]:
    """The names `--recipe` takes (each recipe file's stem)."""
    return [p.stem for p in all_recipes()]


def find_recipe(spec: str | Path) -> Path:
    """A recipe path, or a name: a recipe's own (`qwen3.5-27b`), its model's as published
    (`Qwen3.5-27B`) or its repo id (`Qwen/Qwen3.5-27B`), in any case."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    wanted = str(spec).lower().removesuffix(".toml")
    for candidate in all_recipes():
        repo = _repo_of(candidate).lower()
        if wanted in (candidate.stem, repo, repo.rsplit("/", 1)[-1]):
            return candidate
    raise MtpkitError(f"no recipe {spec}: pass a .toml path or one of {', '.join(recipe_names())}")


def _repo_of(path: Path) -> str:
    try:
        model = tomllib.loads(path.read_text(encoding="utf-8")).get("model") or {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
        return ""
    repo = model.get("repo")
    return repo if isinstance(repo, str) else ""


def load_recipe(spec: str | Path) -> Recipe:
    """Read and check one recipe; unknown keys are an error, not ignored."""
    path = find_recipe(spec)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise MtpkitError(f"recipe {path} is not valid TOML: {e}") from None
    unknown_tables = set(data) - {"model", "convert"}
    if unknown_tables:
        raise MtpkitError(f"recipe {path} has unknown tables: {', '.join(sorted(unknown_tables))}")
    settings = dict(data.get("convert") or {})
    unknown = set(settings) - RECIPE_KEYS
    if unknown:
        raise MtpkitError(
            f"recipe {path} has unknown [convert] keys: {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(RECIPE_KEYS))})"
        )
    model = data.get("model") or {}
    return Recipe(path, model.get("repo"), model.get("family"), settings)


def recipe_note(recipe: Recipe, source: str) -> str | None:
    """A note when `recipe`, written for one model, is applied to `source`, another (known
    from its Hub id, its cache folder, or a local directory's name): its settings were chosen
    for that model's size and may not suit this one."""
    from mtpkit.checkpoint.source import source_repo

    if not recipe.repo:
        return None
    repo = source_repo(source)
    wanted = recipe.repo.lower()
    if repo is not None:
        if repo.lower() == wanted:
            return None
    elif Path(source).expanduser().absolute().name.lower() == wanted.rsplit("/", 1)[-1]:
        return None
    return (
        f"recipe {recipe.path.stem} was written for {recipe.repo}, and {source} is another "
        "model: its settings apply as they are"
    )


def all_recipes() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.toml"))
