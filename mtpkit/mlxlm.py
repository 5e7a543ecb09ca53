"""Every reach into mlx-lm beyond its documented entry points, in one place.

mtpkit imports mlx-lm's own model classes (never a fork of them) and asks them what a
conversion or a head needs. The names used here are mlx-lm internals (`_get_classes`, the
default of `load_model`'s `get_model_classes`, `MODEL_REMAPPING`, the module layout of
`mlx_lm.models`): they are tested against the range `pyproject.toml` pins
(`TESTED_MLX_LM`), and a new mlx-lm release is checked here first.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import re
import sys
import types
from typing import Any

# The mlx-lm releases these reaches are tested with (pyproject.toml's pin).
TESTED_MLX_LM = ">=0.32,<0.33"


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's (Model, ModelArgs) for the config; remapped model types go through mlx-lm."""
    model_type = str(config.get("model_type"))
    if re.fullmatch(r"\w+", model_type):
        try:
            module = mlx_lm_models(model_type)
            return module.Model, module.ModelArgs
        except ImportError:
            pass
    from mlx_lm.utils import _get_classes

    return _get_classes(config=copy.deepcopy(config))


def mlx_lm_models(name: str) -> types.ModuleType:
    """`mlx_lm.models.<name>`, without importing transformers when mlx_lm is not loaded yet.

    `import mlx_lm.models.X` first runs `mlx_lm/__init__.py`, which imports transformers for
    its tokenizer code: ~1.7 s that a conversion never needs. When mlx_lm is not imported
    yet, the model module is loaded under a bare stand-in package and every module loaded
    that way is dropped from `sys.modules` afterwards (the returned module keeps working),
    so a later `import mlx_lm` is the ordinary one.
    """
    if "mlx_lm" in sys.modules:
        return importlib.import_module(f"mlx_lm.models.{name}")
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlx_lm is not installed")
    stand_in = types.ModuleType("mlx_lm")
    stand_in.__path__ = list(spec.submodule_search_locations)
    stand_in.__spec__ = spec
    before = set(sys.modules)
    sys.modules["mlx_lm"] = stand_in
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    finally:
        for loaded in set(sys.modules) - before:
            if loaded == "mlx_lm" or loaded.startswith("mlx_lm."):
                del sys.modules[loaded]


def stock_model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's own (Model, ModelArgs) lookup for `config`, read as the default of its public
    loader's `get_model_classes` parameter (what `mlx_lm.load` uses)."""
    from mlx_lm.utils import load_model

    lookup = inspect.signature(load_model).parameters["get_model_classes"].default
    return lookup(config)


def model_remapping() -> dict[str, str]:
    """mlx-lm's `MODEL_REMAPPING` (`kimi_k2 -> deepseek_v3` style model-type aliases).

    Read on demand: `mlx_lm.utils` imports transformers, which conversion never needs.
    """
    from mlx_lm.utils import MODEL_REMAPPING

    return dict(MODEL_REMAPPING)


def chat_as_text(messages: list[dict[str, Any]]) -> str:
    """A conversation as one text, the way mlx_lm.server renders it for a tokenizer without
    a chat template (its `convert_chat` and default role mapping)."""
    from mlx_lm.server import convert_chat

    return convert_chat(messages)


def apply_adapters(model: Any, adapter_path: Any) -> None:
    """mlx-lm's LoRA (or DoRA) adapters from `adapter_path` applied to `model` in place, as
    `mlx_lm.load(..., adapter_path=...)` applies them; a bad directory is one error line."""
    from pathlib import Path

    from mlx_lm.tuner.utils import load_adapters

    from mtpkit.core.errors import MtpkitError

    if not (Path(adapter_path) / "adapter_config.json").is_file():
        raise MtpkitError(
            f"--adapter-path {adapter_path} has no adapter_config.json: pass the directory "
            "mlx_lm.lora wrote"
        )
    try:
        load_adapters(model, str(adapter_path))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise MtpkitError(f"mlx-lm cannot apply the adapters in {adapter_path}: {e}") from None
    model.eval()


def window_in_temporal_order(cache: Any) -> None:
    """Put a `BatchRotatingKVCache` that one-token steps rotated back in temporal order
    before a pass of several tokens: its `make_mask` reads the write index before its update
    reorders the buffer, and with rows of different padding it would mask from the rotated
    index (mlx-lm's batch generation never follows a one-token step with a longer pass)."""
    if cache.rotated:
        cache._temporal_order()


def cut_window(cache: Any) -> None:
    """Cut a trimmed `BatchRotatingKVCache`'s buffer at its write index: its `trim` only
    moves the index, and a one-token step keeps the buffer's last `window` entries, the
    trimmed ones included. The cache must be in temporal order (after a pass of several
    tokens)."""
    if cache.rotated:
        raise ValueError("a sliding-window cache was not left in temporal order")
    cache.keys = cache.keys[..., : cache._idx, :]
    cache.values = cache.values[..., : cache._idx, :]


def cache_keys_values(cache: Any) -> tuple[Any, Any]:
    """The keys and values an mlx-lm KV cache holds, oldest first ([B, H, S, D] each).

    `KVCache` keeps a buffer longer than its `offset`; a `RotatingKVCache` past its window
    keeps its entries in ring order, and its `_temporal_order` (an mlx-lm internal) puts them
    back in time order, which a reader of another model's cache (Gemma 4's assistant) needs
    to tell the newest entries.
    """
    keys, values = cache.keys, cache.values
    reorder = getattr(cache, "_temporal_order", None)
    if callable(reorder):
        return reorder(keys), reorder(values)
    return keys[..., : cache.offset, :], values[..., : cache.offset, :]


def batch_keys_values(cache: Any) -> tuple[Any, Any, Any]:
    """The keys and values a `BatchKVCache` or `BatchRotatingKVCache` holds, oldest first
    ([B, H, S, D] each), and the index of each row's first valid entry ([B] int32, on the
    device): each row's entries are right-aligned at the write index, its left padding (and
    the entries a row rolled out: `rollback.rows`) before them.

    A rotated window is read in temporal order without reordering the cache itself, as its
    `extract` (an mlx-lm internal's reading: `_idx`, `rotated`) reads one row. Once a
    window's trim has cut into a row's entries its `left_padding` goes negative (every slot
    valid) and no longer counts entries rolled out after that: a reader bounds those itself
    (`gemma4_assistant_rows.AssistantRows.held`).
    """
    import mlx.core as mx

    keys, values = cache.keys, cache.values
    if getattr(cache, "rotated", False):
        keys = mx.roll(keys, -cache._idx, axis=2)
        values = mx.roll(values, -cache._idx, axis=2)
    else:
        keys, values = keys[..., : cache._idx, :], values[..., : cache._idx, :]
    return keys, values, mx.maximum(cache.left_padding, 0).astype(mx.int32)


def eval_private_arrays(model: Any) -> None:
    """Evaluate the arrays mlx-lm's modules keep outside their parameters (`_freqs` of
    its `ProportionalRoPE`, Gemma 4's full-attention RoPE): `load` evaluates the parameters
    only, and a lazy array built on the loading thread cannot be evaluated on another (the
    server's decoding thread: "There is no Stream(cpu, 0) in current thread")."""
    import mlx.core as mx

    arrays = [
        value
        for module in model.modules()
        for key, value in module.items()
        if key.startswith("_") and isinstance(value, mx.array)
    ]
    if arrays:
        mx.eval(arrays)
