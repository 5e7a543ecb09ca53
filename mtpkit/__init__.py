"""mtpkit: keep, convert, run and check multi-token-prediction heads on MLX.

The Python API, as mlx-lm's: `load` a model once, then `generate` (text) or
`stream_generate` (a `TokenEvent` per token) with its MTP head, a draft model or prompt
lookup; `Engine.session(Request(...))` for full control (stop strings, seeds, statistics).
"""

from typing import Any

_API = {
    "load": "mtpkit.speculative.session",
    "generate": "mtpkit.speculative.session",
    "stream_generate": "mtpkit.speculative.session",
    "Engine": "mtpkit.speculative.session",
    "Session": "mtpkit.speculative.session",
    "Request": "mtpkit.speculative.session",
    "TokenEvent": "mtpkit.speculative.session",
    "SamplingSettings": "mtpkit.speculative.accept",
    "DrafterChoice": "mtpkit.speculative.proposers.choose",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    # Read on first use: importing MLX or importlib.metadata takes a tenth of a second, the
    # window in which a Ctrl-C would otherwise end the CLI in a traceback.
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    if name != "__version__":
        raise AttributeError(f"module 'mtpkit' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        # The one version source is pyproject.toml, read from the installed distribution.
        return version("mtpkit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
