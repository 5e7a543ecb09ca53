"""The safetensors header reader against real files and hand-made hostile ones."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from safetensors import safe_open

from mtpkit.checkpoint.headers import HeaderError, parse_header


def read_local(path: Path):
    calls: list[tuple[int, int]] = []

    def read(start: int, length: int) -> bytes:
        calls.append((start, length))
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(length)

    return read, calls


def write_raw(path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(body) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + body + data)
    return path


def test_matches_the_safetensors_library(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(
        str(path),
        {
            "a": mx.zeros((3, 5), dtype=mx.bfloat16),
            "b": mx.ones((7,), dtype=mx.float32),
            "c": mx.zeros((2, 2, 2), dtype=mx.uint32),
        },
        metadata={"format": "pt"},
    )
    read, _ = read_local(path)
    header = parse_header("model.safetensors", path.stat().st_size, read)
    assert header.metadata == {"format": "pt"}
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(header.tensors)
        for name in f.keys():
            sl = f.get_slice(name)
            assert list(header.tensors[name].shape) == sl.get_shape()
            assert header.tensors[name].dtype == sl.get_dtype()
    assert header.tensors["a"].nbytes == 3 * 5 * 2
    # Tensor ranges are absolute file offsets: the last one ends at the end of the file.
    assert max(t.end for t in header.tensors.values()) == path.stat().st_size


@pytest.mark.parametrize(
    "case, header, data, length, message",
    [
        ("huge length", {"a": {}}, b"", 2**62, "exceeds the file size"),
        ("not json", b"{not json", b"", None, "not JSON"),
        ("not an object", [1, 2], b"", None, "not a JSON object"),
        (
            "past eof",
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            b"\0" * 8,
            None,
            "outside",
        ),
        (
            "shape mismatch",
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "its range holds",
        ),
        (
            "bad dtype",
            {"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "unknown dtype",
        ),
        (
            "bad shape",
            {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "invalid shape",
        ),
        (
            "bad offsets",
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [8]}},
            b"\0" * 8,
            None,
            "invalid data_offsets",
        ),
        (
            "reversed offsets",
            {"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}},
            b"\0" * 8,
            None,
            "outside",
        ),
    ],
)
def test_hostile_headers_raise_without_big_reads(
    tmp_path: Path, case: str, header: object, data: bytes, length: int | None, message: str
) -> None:
    path = write_raw(tmp_path / "x.safetensors", header, data, length)
    read, calls = read_local(path)
    with pytest.raises(HeaderError, match=message):
        parse_header("x.safetensors", path.stat().st_size, read)
    # Never asks for more bytes than the file holds, whatever the header claims.
    assert sum(n for _, n in calls) <= path.stat().st_size


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    mx.save_safetensors(str(path), {"w": mx.zeros((64, 64))})
    full = path.read_bytes()
    path.write_bytes(full[: len(full) // 2])
    read, _ = read_local(path)
    with pytest.raises(HeaderError, match="outside"):
        parse_header("t.safetensors", path.stat().st_size, read)
    path.write_bytes(full[:5])
    with pytest.raises(HeaderError, match="too short"):
        parse_header("t.safetensors", 5, read)


def test_large_header_is_read_in_two_requests(tmp_path: Path) -> None:
    # Many tensors make a header larger than the first 64 KiB probe.
    path = tmp_path / "many.safetensors"
    mx.save_safetensors(
        str(path), {f"layer.{i}.weight_with_a_long_name": mx.zeros((1,)) for i in range(2000)}
    )
    read, calls = read_local(path)
    header = parse_header("many.safetensors", path.stat().st_size, read)
    assert len(header.tensors) == 2000
    assert len(calls) == 2
    assert sum(n for _, n in calls) == header.data_start
