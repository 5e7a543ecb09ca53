"""Reading a checkpoint without its weights: `source` (local or Hub) -> `headers` ->
`validate` -> `inspect` -> `runtimes` -> `report`."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "Checkpoint": "inspect",
    "inspect_checkpoint": "report",
    "read_checkpoint": "inspect",
    "Source": "source",
    "open_source": "source",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
