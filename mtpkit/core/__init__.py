"""The shared core: errors, the console, the sidecar manifest, the check prompts."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "MtpkitError": "errors",
    "log": "console",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
