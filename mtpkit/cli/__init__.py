"""The `mtpkit` command line: the Typer `app`, shared `options`, result `output`, one module per
command in `commands/`."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "app": "app",
    "main": "app",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
