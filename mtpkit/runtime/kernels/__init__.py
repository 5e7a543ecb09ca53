"""GPU kernels for the verify pass: the gated-delta-net recurrence over T tokens (`gdn_verify`),
the few-row quantized matmul (`qmv`) on the matrices where it is measured to win (`routing`),
and attention of a few queries without a per-length build (`attention`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "use_fast_verify": "gdn_verify",
    "multi_row_matmuls": "routing",
    "few_query_attention": "attention",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
