"""Rolling a sliding-window KV cache back after a multi-token verify pass."""

from __future__ import annotations

from typing import Any

from mtpkit.core.errors import MtpkitError


def is_rotating_cache(cache: Any) -> bool:
    """A sliding-window KV cache (mlx-lm's RotatingKVCache)."""
    from mlx_lm.models.cache import RotatingKVCache

    return isinstance(cache, RotatingKVCache)


def drop_rotating(cache: Any, n: int) -> None:
    """Drop the last `n` tokens of a sliding-window cache after a multi-token pass.

    A pass over several tokens leaves the cache in temporal order with every token kept
    (`window - 1` old ones plus the new), so cutting the tail is exact. mlx-lm's own `trim`
    only moves the write index, which after the window is full lets stale entries outlive
    older valid ones, and it refuses (`is_trimmable`) past the window anyway.
    """
    keys, values, offset, keep, max_size, idx = cache.state
    if idx != keys.shape[2]:
        raise MtpkitError("a sliding-window cache was not left in temporal order: use --no-mtp")
    end = idx - n
    cache.state = (keys[..., :end, :], values[..., :end, :], offset - n, keep, max_size, end)
