"""Batched MTP decoding: several requests in one round, each row accepting and rolling back
on its own (`decode`), one request's row (`row`) and its draws (`draws`), the head's batched
drafts (`head`), a round built and read (`rounds`), per-row rollback (`rollback`), requests
joining and leaving a batch (`session`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "BatchDecoder": "decode",
    "Row": "row",
    "BatchUnsupported": "rollback",
    "BatchEntry": "session",
    "BatchSession": "session",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
