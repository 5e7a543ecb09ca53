"""The registry of model families, keyed by `model_type` (with aliases).

Every module of this package is imported once, so a family registers itself with
`@register` in its own file: adding a family never edits this one. A `model_type` that
mlx-lm's `MODEL_REMAPPING` maps onto a supported one (`kimi_k2 -> deepseek_v3`) is that
family too.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from mtpkit.core.errors import UnsupportedFamily
from mtpkit.families.base import REGISTRY, BackboneParts, Family, register
from mtpkit.mlxlm import model_remapping

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

FAMILIES = REGISTRY


def _remapped() -> dict[str, str]:
    """mlx-lm's `MODEL_REMAPPING` entries that land on a registered family."""
    remapping = model_remapping()
    return {k: v for k, v in remapping.items() if v in REGISTRY and k not in REGISTRY}


def supported() -> list[str]:
    return sorted({*REGISTRY, *_remapped()})


def family_class(model_type: str) -> type[Family] | None:
    """The family registered for `model_type`, directly or through MODEL_REMAPPING."""
    cls = REGISTRY.get(model_type)
    if cls is None and (target := _remapped().get(model_type)) is not None:
        cls = REGISTRY[target]
    return cls


def family_for(config: dict[str, Any]) -> Family:
    """The family of a config, or an error listing the supported model types.

    The top-level `model_type` decides; a wrapper config whose own type is unknown falls
    back on its `text_config`'s.
    """
    model_type = config.get("model_type")
    text = config.get("text_config")
    cls = family_class(str(model_type)) if model_type is not None else None
    if cls is None and isinstance(text, dict) and text.get("model_type") is not None:
        cls = family_class(str(text["model_type"]))
        model_type = model_type if model_type is not None else text["model_type"]
    if cls is None and model_type is None:
        raise UnsupportedFamily(
            "config.json has no model_type, so its model family is unknown: add the "
            f"original's model_type (supported: {', '.join(supported())})"
        )
    if cls is None:
        raise UnsupportedFamily(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported())}"
        )
    return cls(config)


def backbone_parts(model: Any, config: dict[str, Any]) -> BackboneParts:
    """The parts of a loaded mlx-lm model (`Family.backbone_parts`): its family's reading,
    or mlx-lm's common layout (under `language_model` where it wraps one) for a model type
    no family covers."""
    try:
        return family_for(config).backbone_parts(model)
    except UnsupportedFamily:
        return Family(config).backbone_parts(getattr(model, "language_model", model))


__all__ = [
    "BackboneParts",
    "Family",
    "FAMILIES",
    "backbone_parts",
    "family_class",
    "family_for",
    "register",
    "supported",
]
