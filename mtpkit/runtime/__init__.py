"""The model at run time: stock backbone + MTP head (`model`, `headload`), experts upcast where
MLX needs it (`upcast`), undoing a verify pass (`rollback/`) and the GPU kernels (`kernels/`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "MtpModel": "model",
    "NoMtpHead": "model",
    "load_model": "model",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
