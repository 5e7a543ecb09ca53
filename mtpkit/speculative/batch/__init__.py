"""Batched speculative decoding: several requests in one round, each row accepting and
rolling back on its own (`decode`), one request's row (`row`) and its draws (`draws`), a round
built and read (`rounds`), requests joining and leaving a batch (`session`). The drafters'
batched side is in `speculative/proposers/` (`RowsProposer`), beside each one's one-stream
side; per-row rollback is in `runtime/rollback/` (`rows`, `verify_rows`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "BatchDecoder": "decode",
    "Row": "row",
    "BatchUnsupported": "session",
    "BatchEntry": "session",
    "BatchSession": "session",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
