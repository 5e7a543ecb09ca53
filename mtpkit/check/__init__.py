"""`mtpkit check`: structural checks (`metadata`), numeric probes (`measure`, `variants`,
`probes`), the verdict (`verdict`) and its JUnit report (`junit`)."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "check_checkpoint": "verdict",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
