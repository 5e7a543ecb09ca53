"""Safetensors files written one tensor group at a time, by several threads at once.

The tensors of a file are known (lazily: names, shapes, dtypes) before any is computed, so
each file's header is written first and the file sized; then worker threads, each with its
own MLX stream, compute tensor groups and `pwrite` them at their offsets. Memory holds only
the groups in flight, unlike `mx.save_safetensors`, which keeps every array of its dict
alive, and the output bytes do not depend on which thread wrote what.

Also here: config.json as mlx-lm writes and reads it, and the layout of a conversion's jobs
over shards and files.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import mlx.core as mx

from mtpkit.convert.rules import Job
from mtpkit.core.config import load_json, require_config_object

T = TypeVar("T")

# Source bytes of the jobs being computed at once (beyond one job, however large).
MAX_INFLIGHT_BYTES = 1 << 30

# mlx-lm's shard size (mlx_lm.utils.MAX_FILE_SIZE_GB = 5, in GiB).
MAX_SHARD_BYTES = 5 << 30

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


@dataclass
class FileLayout:
    """A safetensors file whose header is fixed before any tensor is computed."""

    path: Path
    entries: list[tuple[str, tuple[int, ...], mx.Dtype]]
    metadata: dict[str, str] | None = None
    offsets: dict[str, int] = field(default_factory=dict)
    size: int = 0

    def create(self) -> int:
        """Write the header, size the file, and return a descriptor open for pwrite."""
        header: dict[str, object] = {}
        if self.metadata:
            header["__metadata__"] = self.metadata
        offset = 0
        relative: dict[str, int] = {}
        for name, shape, dtype in self.entries:
            nbytes = math.prod(shape) * dtype.size
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            relative[name] = offset
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-(len(raw) + 8) % 8)
        start = 8 + len(raw)
        self.offsets = {name: start + off for name, off in relative.items()}
        self.size = start + offset
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(fd, self.size)
        return fd


Destinations = dict[str, list[tuple[int, int]]]  # entry name -> [(fd, offset)]


def run_jobs(
    jobs: Sequence[T],
    compute: Callable[[T], list[tuple[str, mx.array]]],
    destinations: Destinations,
    *,
    workers: int,
    size: Callable[[T], int] = lambda _: 0,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Compute every job on `workers` threads and pwrite its entries where they belong.

    Each thread has its own MLX stream (MLX's CPU kernels then run in parallel). At most two
    jobs per worker, and at most `max_inflight_bytes` of their inputs (`size`), are in flight
    (one job always may be, however large), so memory stays bounded; each job's arrays are
    dropped once written.
    """
    local = threading.local()
    streams: list[mx.Stream] = []
    lock = threading.Lock()

    def run(job: T) -> None:
        if not hasattr(local, "stream"):
            local.stream = mx.new_stream(mx.cpu)
            with lock:
                streams.append(local.stream)
        written = 0
        try:
            with mx.stream(local.stream):
                entries = [(n, mx.contiguous(a)) for n, a in compute(job)]
                mx.eval([a for _, a in entries])
                for name, array in entries:
                    view = _BYTE_VIEWS.get(array.dtype)
                    data = memoryview(array.view(view) if view is not None else array).cast("B")
                    for fd, offset in destinations[name]:
                        _pwrite_all(fd, data, offset)
                    written += array.nbytes
                del entries
        finally:
            # A stream with pending work at thread exit aborts the process (mlx 0.32).
            mx.synchronize(local.stream)
        if on_bytes is not None:
            on_bytes(written)

    if workers <= 1:
        with ThreadPoolExecutor(1) as pool:
            for job in jobs:
                pool.submit(run, job).result()
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[Future[None], int]] = deque()
        inflight = 0
        try:
            for job in jobs:
                nbytes = size(job)
                while pending and (
                    len(pending) >= 2 * workers or inflight + nbytes > max_inflight_bytes
                ):
                    future, done = pending.popleft()
                    future.result()
                    inflight -= done
                pending.append((pool.submit(run, job), nbytes))
                inflight += nbytes
            while pending:
                pending.popleft()[0].result()
        except BaseException:
            for future, _ in pending:
                future.cancel()
            raise


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def default_workers() -> int:
    """Worker threads: MTPKIT_THREADS, else the CPU count (at most 4: memory grows with it)."""
    value = os.environ.get("MTPKIT_THREADS")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, min(4, os.cpu_count() or 1))


def write_index(
    path: Path, weight_map: dict[str, str], total_size: int, total_parameters: int
) -> None:
    """`model.safetensors.index.json` as mlx-lm's save_model writes it."""
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path.write_text(json.dumps(index, indent=4))


# --------------------------------------------------------------------------- config.json

# mlx-lm's tags for floats JSON cannot hold (`mlx_lm.utils._encode_tagged_floats`): a bare
# NaN or Infinity is not JSON, and mlx-lm's load_config turns these back into floats.
FLOAT_TAG_KEY = "__float__"
FLOAT_TAGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_floats(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by mlx-lm's tag."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if math.isnan(obj):
            return {FLOAT_TAG_KEY: "NaN"}
        return {FLOAT_TAG_KEY: "Infinity" if obj > 0 else "-Infinity"}
    if isinstance(obj, dict):
        return {k: encode_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_floats(v) for v in obj]
    return obj


def decode_floats(obj: Any) -> Any:
    """`obj` with mlx-lm's tags turned back into floats (what its load_config returns)."""
    if isinstance(obj, dict):
        if set(obj) == {FLOAT_TAG_KEY} and obj[FLOAT_TAG_KEY] in FLOAT_TAGS:
            return FLOAT_TAGS[obj[FLOAT_TAG_KEY]]
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj


def read_config(path: Path) -> dict[str, Any]:
    """A config.json as mlx-lm's load_config reads it (tagged floats decoded)."""
    config = load_json(path.read_text(), str(path))
    return decode_floats(require_config_object(config, str(path.parent)))


def write_config(path: Path, config: dict[str, Any]) -> None:
    """config.json exactly as `mlx_lm.utils.save_config` writes it: `_name_or_path` and
    `vision_config` dropped, `quantization` mirrored into `quantization_config`, keys
    sorted, non-finite floats tagged. Mirrored rather than imported for the reason given
    at `mtpkit.convert.quant.infer_spec` (importing mlx_lm.utils loads transformers)."""
    config = dict(config)
    config.pop("_name_or_path", None)
    config.pop("vision_config", None)
    if "quantization" in config:
        config["quantization_config"] = config["quantization"]
    config = dict(sorted(config.items()))
    with open(path, "w") as f:
        json.dump(encode_floats(config), f, indent=4)


# --------------------------------------------------------------------------- jobs to files


def shard_jobs(jobs: list[Job], max_bytes: int = MAX_SHARD_BYTES) -> list[list[Job]]:
    """Jobs in order over shards of at most `max_bytes` (mlx-lm's make_shards, per job)."""
    shards: list[list[Job]] = []
    size = 0
    for job in jobs:
        if not shards or size + job.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += job.nbytes
    return shards


def tensor_meta(entries: list[tuple[str, mx.array]]) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Name -> (shape, dtype) of lazy output entries (what a file header needs)."""
    return {n: (tuple(a.shape), a.dtype) for n, a in entries}


def write_job_files(
    files: list[tuple[Path, list[Job]]],
    compute: Callable[[Job], list[tuple[str, mx.array]]],
    meta: dict[str, tuple[tuple[int, ...], mx.Dtype]],
    on_bytes: Callable[[int], None] | None = None,
    renames: dict[Path, Callable[[str], str]] | None = None,
) -> None:
    """Lay out every file, then compute each job once and write it to every file it is in.

    `renames[path]` names the entries in that file's header (the same tensors under other
    keys, e.g. the peers' `mtp.safetensors`)."""
    destinations: Destinations = {}
    fds: list[int] = []
    order: list[Job] = []
    seen: set[int] = set()
    try:
        for path, jobs in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            rename = (renames or {}).get(path, lambda n: n)
            names = [n for job in jobs for n in job.entry_names]
            entries = [(rename(n), *meta[n]) for n in names]
            layout = FileLayout(path, entries, metadata={"format": "mlx"})
            fd = layout.create()
            fds.append(fd)
            for name in names:
                destinations.setdefault(name, []).append((fd, layout.offsets[rename(name)]))
            for job in jobs:
                if id(job) not in seen:
                    seen.add(id(job))
                    order.append(job)
        run_jobs(
            order,
            compute,
            destinations,
            workers=default_workers(),
            size=lambda job: job.source_bytes,
            on_bytes=on_bytes,
        )
    finally:
        for fd in fds:
            os.close(fd)
