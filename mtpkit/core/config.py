"""Reading counts from a config.json: what every stage that builds names from a config needs.

A count (`num_hidden_layers`, an expert count, an MTP layer count) is an integer as JSON
spells it; anything else is `invalid_config` (`mtpkit.checkpoint.validate` reports the other
config problems under that code).
"""

from __future__ import annotations

from typing import Any

from mtpkit.core.errors import InvalidConfig

# The stable problem code of a config value with the wrong type or range (README.md).
INVALID_CONFIG = "invalid_config"


def as_count(value: Any) -> int | None:
    """An integer count as JSON spells it (`1`, also `1.0`), else None (`"one"`, `true`)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def require_count(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """A count the checkpoint's layout depends on (`num_hidden_layers`, expert counts);
    anything but an integer is an error, as nothing can be read without it."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    count = as_count(value)
    if count is None or count < 0:
        raise InvalidConfig(
            f"config.json: {key}={value!r} is not a non-negative integer ({INVALID_CONFIG}): "
            "fix config.json"
        )
    return count
