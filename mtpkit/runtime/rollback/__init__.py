"""Undoing the rejected part of a verify pass, per cache kind: KV trim and sliding window
(`window`), gated-delta-net snapshots (`gdn`), replay (`replay`); `verify_pass` picks for one
stream, `verify_rows` for the rows of a batch, each row to its own count (`rows`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "VerifyPass": "verify_pass",
    "BatchVerifyPass": "verify_rows",
    "BatchUnsupported": "rows",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
