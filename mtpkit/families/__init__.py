"""The registry of model families, keyed by `model_type` (with aliases)."""

from __future__ import annotations

from typing import Any

from mtpkit.errors import UnsupportedFamily
from mtpkit.families.base import Family
from mtpkit.families.deepseek_v3 import DeepseekV3
from mtpkit.families.glm4_moe import Glm4Moe
from mtpkit.families.mimo import Mimo
from mtpkit.families.qwen3_5 import Qwen3_5, Qwen3_5Moe
from mtpkit.families.qwen3_next import Qwen3Next

FAMILIES: dict[str, type[Family]] = {}
for _cls in (Qwen3_5, Qwen3_5Moe, Qwen3Next, DeepseekV3, Glm4Moe, Mimo):
    FAMILIES[_cls.name] = _cls
    for _alias in _cls.aliases:
        FAMILIES[_alias] = _cls


def supported() -> list[str]:
    return sorted(FAMILIES)


def family_for(config: dict[str, Any]) -> Family:
    """The family of a config, or an error listing the supported model types."""
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    cls = FAMILIES.get(str(model_type))
    if cls is None:
        raise UnsupportedFamily(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported())}"
        )
    return cls(config)


__all__ = ["Family", "FAMILIES", "family_for", "supported"]
