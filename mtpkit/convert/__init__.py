"""Converting a checkpoint: `recipes` -> `plan` -> `reader` -> `rules` -> `quant` -> `writer`,
written through `destination` (a temporary sibling renamed at the end); `pipeline` runs them."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "ConvertFlags": "pipeline",
    "ConvertResult": "pipeline",
    "Settings": "pipeline",
    "convert": "pipeline",
    "graft": "grafting",
    "resolve_settings": "pipeline",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
