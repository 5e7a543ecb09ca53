"""A cache's state, kept and put back: what undoing a pass (`discard`), replaying one
(`replay`), a draft model's chain of drafts and the session's prompt cache all rest on.

MLX arrays are immutable values, so keeping a state is keeping handles: nothing is copied.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def handle(value: Any) -> Any:
    """A new handle on an array's current value (no copy, no graph node): mlx-lm's KV caches
    write into their buffers with `keys[..., a:b, :] = ...`, which changes the array object
    in place, so a plain reference would see the write."""
    return value[...] if isinstance(value, mx.array) and value.ndim else value


def saved_state_of(attributes: dict[str, Any]) -> dict[str, Any]:
    """Handles on every attribute's value. Lists (ArraysCache's slots) are copied because
    layers assign into them in place."""
    return {
        k: [handle(x) for x in v] if isinstance(v, list) else handle(v)
        for k, v in attributes.items()
    }


def saved_state(cache: Any) -> dict[str, Any]:
    """A cache's whole state (its attributes), to be put back by `restore_state`."""
    return saved_state_of(vars(cache))


def restore_state(cache: Any, saved: dict[str, Any]) -> None:
    """Put `saved` (from `saved_state`) back into `cache`; `saved` stays usable again."""
    vars(cache).update(saved_state_of(saved))


def is_cache(value: Any) -> bool:
    """An mlx-lm cache object (every kind has `is_trimmable`)."""
    return hasattr(value, "is_trimmable") and hasattr(value, "state")


def fork_cache(cache: Any) -> Any:
    """A cache object of the same kind holding the same state, that changes on its own from
    now on (a prompt cache's entry, the session that continues from it)."""
    import copy

    forked = copy.copy(cache)
    restore_state(forked, saved_state(cache))
    for name, value in vars(forked).items():  # mlx-lm's CacheList: its caches forked too
        if isinstance(value, (list, tuple)) and value and all(is_cache(v) for v in value):
            setattr(forked, name, type(value)(fork_cache(v) for v in value))
    return forked


def can_fork(caches: list[Any]) -> bool:
    """Whether `fork_cache` forks each: a cache whose state is its attributes (every mlx-lm
    kind; a CacheList's caches are forked in turn)."""
    return all(hasattr(cache, "__dict__") for cache in caches)
