"""`mtpkit bench`: plain against MTP decoding (`speed`), random models of real shapes (`shapes`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "BenchResult": "speed",
    "bench": "speed",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
