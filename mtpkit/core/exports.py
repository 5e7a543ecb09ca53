"""Package entry points imported on first use, so that importing one stage never runs another.

A package's `__init__` names its entry points and the module each lives in; nothing is
imported until a name is asked for (huggingface_hub exports its API the same way). This keeps
`mtpkit --help` and the early option checks free of MLX's import time, and keeps the import
graph exactly the modules' own imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` that imports `exports[name]` (a submodule of `package`) on use."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
