"""mtpkit: keep, convert, run and check multi-token-prediction heads on MLX."""

from importlib.metadata import PackageNotFoundError, version

try:
    # The one version source is pyproject.toml, read from the installed distribution.
    __version__ = version("mtpkit")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
