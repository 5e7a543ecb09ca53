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
RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class Recipe:
    path: Path
    repo: str | None
    family: str | None
    settings: dict[str, Any] = field(default_factory=dict)


def find_recipe(spec: str | Path) -> Path:
    """A recipe path, or a bare name looked up in the repository's `recipes/` folder."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / f"{spec}", RECIPES_DIR / f"{spec}.toml"):
        if candidate.is_file():
            return candidate
    raise MtpkitError(f"no recipe {spec}: pass a .toml path (see recipes/)")


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


def all_recipes() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.toml"))
