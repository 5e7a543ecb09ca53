"""`mtpkit train-head`: `data` -> `init_head` -> `loop` (with `checkpoint`s) -> `output`."""

from mtpkit.core.exports import lazy_exports

_EXPORTS = {
    "TrainSettings": "loop",
    "train_and_write": "loop",
    "train_head": "loop",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
