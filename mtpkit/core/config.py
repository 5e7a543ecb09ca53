"""Reading counts from a config.json: what every stage that builds names from a config needs.

A count (`num_hidden_layers`, an expert count, an MTP layer count) is an integer as JSON
spells it; anything else is `invalid_config` (`mtpkit.checkpoint.validate` reports the other
config problems under that code).
"""

from __future__ import annotations

import json
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


def load_json(text: str | bytes, what: str) -> Any:
    """`json.loads` of a file that came with a checkpoint: nesting past Python's recursion
    limit (a config nested 100,000 deep) is one error naming the file, not a RecursionError.
    Other JSON errors are the caller's to name."""
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidConfig(
            f"{what} is nested too deeply to read (past Python's recursion limit): replace it "
            "with the original checkpoint's"
        ) from None


def require_config_object(config: Any, where: str) -> dict[str, Any]:
    """config.json's shape every reader relies on: a JSON object, and a wrapper's
    `text_config` an object too (a list there is `invalid_config`, not an AttributeError)."""
    if not isinstance(config, dict):
        raise InvalidConfig(f"config.json in {where} is not a JSON object ({INVALID_CONFIG})")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise InvalidConfig(
            f"config.json in {where}: text_config is a {type(text).__name__}, not an object "
            f"({INVALID_CONFIG}): fix config.json or convert from the original checkpoint"
        )
    return config
