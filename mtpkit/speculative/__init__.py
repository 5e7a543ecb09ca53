"""Speculative decoding: the drafters behind one protocol (`proposers/`), accepting on the
device (`accept`), adaptive drafting (`adaptive`), the draft/verify/accept round and its loop
(`decode`, rounds looked ahead as `look_ahead` decides), batched rows (`batch/`), plain
decoding (`plain`), a loaded model serving requests (`session`, with its `prompt_cache` and
`text`), prompt-to-text generation (`generate`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "AdaptiveDrafting": "decode",
    "MtpDecoder": "decode",
    "SamplingSettings": "decode",
    "Stats": "decode",
    "Engine": "session",
    "Request": "session",
    "Session": "session",
    "TokenEvent": "session",
    "GenerationResult": "generate",
    "measure_acceptance": "generate",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
