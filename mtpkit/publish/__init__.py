"""Publishing a conversion to the Hub: its model card (`card`) and the checked, one-commit
upload (`upload`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "model_card": "card",
    "upload": "upload",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
