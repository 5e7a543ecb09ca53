"""Safetensors files written one tensor at a time, and mlx-lm's sharded layout.

The tensors of a file are known (lazily: names, shapes, dtypes) before any is computed, so
the header goes first and each tensor is evaluated, written and released in turn: writing a
shard never holds more than one tensor group in memory, unlike `mx.save_safetensors`,
which keeps every array of its dict alive.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx

# mlx-lm's shard size (mlx_lm.utils.MAX_FILE_SIZE_GB = 5, in GiB).
MAX_SHARD_BYTES = 5 << 30
# Tensors evaluated together: enough work per `mx.eval` call to keep the cores busy.
EVAL_BATCH_BYTES = 64 << 20

SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.float32: "F32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float64: "F64",
}
# Plain views used to hand bytes to the file (the buffer protocol knows no bfloat16).
_BYTE_VIEWS = {mx.bfloat16: mx.uint16}


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(
    entries: Sequence[tuple[str, mx.array]], max_bytes: int = MAX_SHARD_BYTES
) -> list[list[tuple[str, mx.array]]]:
    """Split tensors in order into shards of at most `max_bytes` (mlx-lm's make_shards)."""
    shards: list[list[tuple[str, mx.array]]] = []
    size = 0
    for name, array in entries:
        if not shards or size + array.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, array))
        size += array.nbytes
    return shards


def write_safetensors(
    path: Path,
    entries: list[tuple[str, mx.array]],
    *,
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write `entries` (lazy arrays) to `path`, evaluating and releasing them as it goes.

    `entries` is emptied: each array is dropped once written, so the caller must not keep
    other references if it wants the memory back.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, array in entries:
        dtype = SAFETENSORS_DTYPES.get(array.dtype)
        if dtype is None:
            raise ValueError(f"{name}: dtype {array.dtype} cannot be stored in safetensors")
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)  # the format pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        i = 0
        while i < len(entries):
            # Evaluate a batch together, then write and drop it.
            j, batch_bytes = i, 0
            while j < len(entries) and (j == i or batch_bytes < EVAL_BATCH_BYTES):
                batch_bytes += entries[j][1].nbytes
                j += 1
            for k in range(i, j):
                # Slices and axis moves are views; the file needs row-major bytes.
                entries[k] = (entries[k][0], mx.contiguous(entries[k][1]))
            mx.eval([a for _, a in entries[i:j]])
            for k in range(i, j):
                name, array = entries[k]
                entries[k] = (name, None)  # type: ignore[assignment]
                view = _BYTE_VIEWS.get(array.dtype)
                data = array.view(view) if view is not None else array
                if data.nbytes:
                    f.write(memoryview(data))
                if on_bytes is not None:
                    on_bytes(array.nbytes)
                del array, data
            i = j


def write_index(
    path: Path, weight_map: dict[str, str], total_size: int, total_parameters: int
) -> None:
    """`model.safetensors.index.json` as mlx-lm's save_model writes it."""
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path.write_text(json.dumps(index, indent=4))
