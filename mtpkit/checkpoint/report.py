"""What `mtpkit inspect` reports: a checkpoint as inspect read it (`inspect.py`), with the
runtimes that can use its head (`runtimes.py`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mtpkit.checkpoint.inspect import (
    HEAD_UNUSABLE,
    Checkpoint,
    mtp_norm_convention,
    read_checkpoint,
)
from mtpkit.checkpoint.runtimes import head_layout, runtimes
from mtpkit.core.errors import MtpkitError
from mtpkit.families.base import expert_layout


def report(ckpt: Checkpoint) -> dict[str, Any]:
    """The JSON object `inspect --json` prints (keys documented in README.md)."""
    mtp = sorted(ckpt.mtp_tensors, key=lambda t: t.name)
    tensors = []
    for t in mtp:
        entry: dict[str, Any] = {
            "name": t.name,
            "shape": list(t.shape),
            "dtype": t.dtype,
            "shard": t.shard,
            "bytes": t.nbytes,
        }
        original = ckpt.family.duplicate_of(t.name)
        if original is not None:
            entry["duplicate_of"] = original
        tensors.append(entry)
    total = sum(t.nbytes for t in mtp)
    duplicates = sum(e["bytes"] for e in tensors if "duplicate_of" in e)
    head_names = [t.name for t in mtp if ckpt.family.duplicate_of(t.name) is None]
    return {
        "source": ckpt.source.spec,
        "revision": ckpt.source.revision,
        "commit": ckpt.source.commit,
        "format": ckpt.format,
        "model_type": ckpt.config.get("model_type"),
        "family": ckpt.family.name,
        "shards": ckpt.shards,
        "mtp": {
            "declared_layers": ckpt.family.declared_mtp_layers(),
            "present": bool(mtp),
            "tensor_count": len(mtp),
            "bytes": total,
            "bytes_needed": total - duplicates,
            "shards": sorted({t.shard for t in mtp}),
            "expert_layout": expert_layout(head_names),
            "layout": head_layout(ckpt),
            "peer_files": ckpt.peer_files,
            "norm_convention": mtp_norm_convention(ckpt),
            "concat_order": (ckpt.manifest or {}).get("concat_order", ckpt.family.concat_order),
            "hidden": (ckpt.manifest or {}).get("hidden"),
            "dtypes": dict(sorted(Counter(t.dtype for t in mtp).items())),
            "quantized": any(t.name.endswith(".scales") for t in mtp),
            "tensors": tensors,
        },
        "pairing": ckpt.family.pairing(),
        "problems": ckpt.problems,
        "runtimes": runtimes(ckpt),
    }


def inspect_checkpoint(
    source: str, *, revision: str | None = None, target: str | None = None
) -> dict[str, Any]:
    """Read a checkpoint's headers and report its MTP head (see `report`), or a block
    drafter's layout (`mtpkit.checkpoint.drafters`; checked against `target` if given)."""
    from mtpkit.checkpoint.drafters import inspect_drafter

    drafter = inspect_drafter(source, revision=revision, target=target)
    if drafter is not None:
        return drafter
    if target is not None:
        raise MtpkitError(f"--target checks a block drafter against its target; {source} is none")
    return report(read_checkpoint(source, revision=revision))


def head_state(result: dict[str, Any]) -> str:
    """`ok`, `absent`, `missing` (declared, no tensors) or `incomplete` (a block drafter:
    `ok` or `incomplete`)."""
    if "drafter" in result:
        return "incomplete" if result["problems"] else "ok"
    codes = {p["code"] for p in result["problems"]}
    if "mtp_declared_not_present" in codes:
        return "missing"
    if not result["mtp"]["present"]:
        return "absent"
    if codes & HEAD_UNUSABLE:
        return "incomplete"
    return "ok"
