"""Safetensors headers, read and validated without trusting the file.

A header is `u64 little-endian length` + that many bytes of JSON. Every field is checked
against the file size before use, so a hostile or truncated file costs a bounded read and
yields a problem instead of an allocation of whatever the length field claims.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mtpkit.checkpoint.validate import offsets_problem
from mtpkit.core.errors import CheckpointProblem

# The safetensors format caps headers at 100 MB; anything larger is corrupt by definition.
MAX_HEADER_BYTES = 100_000_000
# First read of a remote shard: the length field plus most real headers in one request.
HEADER_PROBE_BYTES = 64 * 1024

DTYPE_BYTES: dict[str, float] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
    "F4": 0.5,
}


class HeaderError(ValueError):
    """The header is not a valid safetensors header for a file of this size."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    # Absolute byte offsets in the file (header included), end exclusive.
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardHeader:
    shard: str
    file_size: int
    data_start: int
    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]


def parse_header(shard: str, file_size: int, read: Callable[[int, int], bytes]) -> ShardHeader:
    """Read and validate one shard's header; `read(start, length)` returns file bytes."""
    if file_size < 8:
        raise HeaderError(f"{shard}: {file_size} bytes is too short for a safetensors file")
    probe = read(0, min(file_size, HEADER_PROBE_BYTES))
    if len(probe) < 8:
        raise HeaderError(f"{shard}: truncated before the header length")
    (length,) = struct.unpack("<Q", probe[:8])
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise HeaderError(
            f"{shard}: header length {length} exceeds the file size {file_size} or the 100 MB limit"
        )
    raw = probe[8 : 8 + length]
    if len(raw) < length:
        raw += read(len(probe), 8 + length - len(probe))
    if len(raw) != length:
        raise HeaderError(f"{shard}: truncated header ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise HeaderError(f"{shard}: header is not JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{shard}: header is not a JSON object")

    data_start = 8 + length
    data_size = file_size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise HeaderError(f"{shard}: __metadata__ is not an object")
    odd = next((k for k, v in metadata.items() if not isinstance(v, str)), None)
    if odd is not None:  # the safetensors format allows only strings; its loaders refuse others
        raise HeaderError(
            f"{shard}: __metadata__ value {odd!r} is a {type(metadata[odd]).__name__}, not a "
            "string (the safetensors format allows only strings)"
        )
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(shard, name, entry, data_start, data_size)
    spans = ((t.name, t.start - data_start, t.end - data_start) for t in tensors.values())
    layout = offsets_problem(spans, data_size)
    if layout is not None:
        raise HeaderError(f"{shard}: {layout}")
    return ShardHeader(shard, file_size, data_start, metadata, tensors)


def _tensor_info(
    shard: str, name: str, entry: object, data_start: int, data_size: int
) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(f"{shard}: entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise HeaderError(f"{shard}: {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise HeaderError(f"{shard}: {name} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise HeaderError(f"{shard}: {name} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise HeaderError(
            f"{shard}: {name} data_offsets {offsets} fall outside the {data_size} data bytes"
        )
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if expected != end - begin:
        raise HeaderError(
            f"{shard}: {name} is {dtype}{shape} = {expected:g} bytes but its range holds "
            f"{end - begin}"
        )
    return TensorInfo(name, dtype, tuple(shape), shard, data_start + begin, data_start + end)


def require_valid_headers(directory: Path, where: str) -> list[str]:
    """The header of every safetensors file a model directory's loaders read (mlx-lm's
    `*.safetensors`, the head's `mtp/`), validated as inspect validates them, before MLX reads
    any: a truncated shard, overlapping ranges or a 2^62 header length is one line naming
    `corrupt_header`, never MLX's `[load_safetensors]` error or a decode of overlapping bytes.
    Returns the tensor names the files hold."""
    names: list[str] = []
    files = sorted([*directory.glob("*.safetensors"), *(directory / "mtp").glob("*.safetensors")])
    for path in files:
        try:
            with path.open("rb") as f:

                def read(start: int, length: int, f: BinaryIO = f) -> bytes:
                    f.seek(start)
                    return f.read(length)

                header = parse_header(
                    str(path.relative_to(directory)), os.fstat(f.fileno()).st_size, read
                )
                names += header.tensors
        except (HeaderError, OSError) as e:
            detail = str(e) if isinstance(e, HeaderError) else f"{path.name}: {e.strerror}"
            raise CheckpointProblem(
                f"{where} cannot be loaded (corrupt_header): {detail}; `mtpkit inspect {where}` "
                "lists every problem"
            ) from None
    return names
