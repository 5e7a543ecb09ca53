"""mtpkit: keep, convert, run and check multi-token-prediction heads on MLX."""

from typing import Any


def __getattr__(name: str) -> Any:
    # `__version__` is read on first use: importing importlib.metadata takes a tenth of a
    # second, the window in which a Ctrl-C would otherwise end the program in a traceback.
    if name != "__version__":
        raise AttributeError(f"module 'mtpkit' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        # The one version source is pyproject.toml, read from the installed distribution.
        return version("mtpkit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
