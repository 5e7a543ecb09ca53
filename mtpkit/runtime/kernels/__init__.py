"""GPU kernels for the verify pass: the gated-delta-net recurrence over T tokens (`gdn_verify`)
and the few-row quantized matmul (`qmv`), on the matrices where it is measured to win (`routing`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "use_fast_verify": "gdn_verify",
    "multi_row_matmuls": "routing",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
