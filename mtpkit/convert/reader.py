"""Lazy tensors of a checkpoint, shard by shard, fetching from the Hub only what is needed.

Hand-written rather than `safe_open` or `hf_hub_download` alone: on the Hub only the needed
tensors' byte ranges are fetched (a head graft reads megabytes of a terabyte checkpoint),
and the tensors still come out as lazy MLX arrays read when evaluated.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.checkpoint.headers import TensorInfo
from mtpkit.checkpoint.inspect import Checkpoint
from mtpkit.core.errors import MtpkitError


@dataclass(frozen=True)
class Ref:
    """A source tensor: a local safetensors file and the tensor's name in it."""

    path: str
    name: str


def load_tensors(path: str) -> dict[str, mx.array]:
    """Every tensor of a safetensors file, lazily (read when evaluated)."""
    return mx.load(path)


class TensorReader:
    """Lazy tensors of a checkpoint, one shard at a time, fetching only what is needed.

    Local shards are opened with `mx.load` (lazy: a tensor is read when evaluated). On the
    Hub, a shard nearly all of whose bytes are needed is downloaded (into the HF cache, as
    mlx-lm does); otherwise only the needed tensors' byte ranges are fetched, in bounded chunks,
    into a temporary safetensors file that is then opened lazily too, so memory stays flat
    whatever the head's size. `close()` removes those files once the output is written.
    """

    # Gaps below this are read through rather than split into another request.
    COALESCE_GAP = 64 << 10
    CHUNK_BYTES = 256 << 20
    # Download a whole shard only when nearly all of it is needed: DeepSeek's duplicated
    # embedding and head copies (1.7 GB each) are then never fetched.
    DOWNLOAD_FRACTION = 0.9

    def __init__(self, ckpt: Checkpoint, needed: set[str], *, ranged: bool = False) -> None:
        self.ckpt = ckpt
        self.needed = needed
        self.ranged = ranged
        self.tmpdir: Path | None = None

    def shard(self, shard: str) -> Iterator[tuple[TensorInfo, Ref]]:
        header = self.ckpt.headers[shard]
        infos = sorted(
            (t for t in header.tensors.values() if t.name in self.needed), key=lambda t: t.start
        )
        if not infos:
            return
        source = self.ckpt.source
        needed_bytes = sum(t.nbytes for t in infos)
        if source.kind == "local" or (
            not self.ranged and needed_bytes >= self.DOWNLOAD_FRACTION * header.file_size
        ):
            path = source.local_file(shard)
        else:
            path = self._fetch_ranges(shard, infos)
        for info in infos:
            yield info, Ref(str(path), info.name)

    def _fetch_ranges(self, shard: str, infos: list[TensorInfo]) -> Path:
        """Copy the tensors' bytes into a local safetensors file holding only them."""
        if self.tmpdir is None:
            self.tmpdir = Path(tempfile.mkdtemp(prefix="mtpkit-ranges-"))
        path = self.tmpdir / f"{len(list(self.tmpdir.iterdir()))}.safetensors"
        header: dict[str, Any] = {}
        offset = 0
        for info in infos:
            header[info.name] = {
                "dtype": info.dtype,
                "shape": list(info.shape),
                "data_offsets": [offset, offset + info.nbytes],
            }
            offset += info.nbytes
        raw = json.dumps(header).encode("utf-8")
        raw += b" " * (-(len(raw) + 8) % 8)
        with open(path, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for run in coalesce(infos, self.COALESCE_GAP):
                self._copy_run(f, shard, run)
        return path

    def _copy_run(self, f: Any, shard: str, run: list[TensorInfo]) -> None:
        """Fetch one run of nearby tensors in bounded chunks, writing only their bytes."""
        for start in range(run[0].start, run[-1].end, self.CHUNK_BYTES):
            end = min(start + self.CHUNK_BYTES, run[-1].end)
            data = self.ckpt.source.read_bytes_range(shard, start, end - start)
            if len(data) != end - start:
                raise MtpkitError(
                    f"{shard}: asked for {end - start} bytes at {start}, got {len(data)}"
                )
            for info in run:  # the parts of needed tensors inside [start, end)
                lo, hi = max(info.start, start), min(info.end, end)
                if lo < hi:
                    f.write(memoryview(data)[lo - start : hi - start])
            del data

    def close(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def coalesce(infos: list[TensorInfo], gap: int) -> Iterator[list[TensorInfo]]:
    """Runs of tensors (sorted by offset) whose gaps are at most `gap` bytes."""
    run: list[TensorInfo] = []
    for info in infos:
        if run and info.start - run[-1].end > gap:
            yield run
            run = []
        run.append(info)
    if run:
        yield run


class ThreadLoads:
    """Source arrays for the writer's worker threads: each thread opens the files itself
    (MLX arrays belong to their thread's stream) and hands every tensor out once."""

    def __init__(self) -> None:
        self.local = threading.local()

    def arrays(self, refs: list[Ref]) -> list[mx.array]:
        if not hasattr(self.local, "loads"):
            self.local.loads = {}
        cache: dict[str, dict[str, mx.array]] = self.local.loads
        arrays = []
        for r in refs:
            loaded = cache.get(r.path)
            if loaded is None:
                loaded = cache[r.path] = load_tensors(r.path)
            arrays.append(loaded.pop(r.name))
        return arrays
