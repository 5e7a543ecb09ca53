"""GPU kernels and routes: the gated-delta-net recurrence over T tokens in one launch (`gdn_verify`:
verify passes, and on CUDA prefill chunks and plain steps), the few-row quantized matmul (`qmv`)
on the matrices where it is measured to win (`routing`), attention of a few queries without a
per-length build (`attention`), and a prompt's chunk or a verify pass without cuDNN builds per
shape (`prompt`: the depthwise conv1d and long attention from ops)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "use_fast_verify": "gdn_verify",
    "multi_row_matmuls": "routing",
    "few_query_attention": "attention",
    "prompt_chunk": "prompt",
    "conv_by_ops": "prompt",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
