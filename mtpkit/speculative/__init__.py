"""Speculative decoding with the head: accept (`accept`), the draft/verify/accept round and its
loop (`decode`), prompt-to-text generation (`generate`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "AdaptiveDrafting": "decode",
    "MtpDecoder": "decode",
    "SamplingSettings": "decode",
    "Stats": "decode",
    "GenerationResult": "generate",
    "measure_acceptance": "generate",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
