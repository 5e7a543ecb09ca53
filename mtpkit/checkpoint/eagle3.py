"""What `mtpkit inspect` reports of an EAGLE-3 drafter (`mtpkit.families.eagle3`): its target,
the target layers it reads, its draft vocabulary and `d2t` map, and what is wrong, from
config.json, the safetensors headers and the bytes of its two small vocabulary maps.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from mtpkit.checkpoint.drafters import read_headers, target_text_config
from mtpkit.checkpoint.headers import TensorInfo
from mtpkit.checkpoint.source import Source
from mtpkit.families.eagle3 import Eagle3Layout, tensor_name, tensor_problem

MAX_MAP_BYTES = 64 * 1024 * 1024  # a vocabulary map past this is not read (no real one is)
NUMPY_DTYPES = {"I64": "<i8", "I32": "<i4", "BOOL": "?", "U8": "u1"}
DEFAULT_RULE = "inputs of target layers 2, N // 2, N - 3 (EAGLE's default)"


def read_map(source: Source, info: TensorInfo | None) -> np.ndarray | None:
    """A small integer or bool tensor's values (None: absent, too large, or another dtype)."""
    if info is None or info.dtype not in NUMPY_DTYPES or info.nbytes > MAX_MAP_BYTES:
        return None
    raw = source.read_bytes_range(info.shard, info.start, info.nbytes)
    return np.frombuffer(raw, dtype=NUMPY_DTYPES[info.dtype]).reshape(info.shape)


def vocabulary(layout: Eagle3Layout, d2t: np.ndarray | None,
               t2d: np.ndarray | None) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """The `d2t` report and what is wrong with the maps."""
    problems = []
    report: dict[str, Any] = {"present": d2t is not None, "target_ids": None, "distinct": None}
    if d2t is not None and d2t.shape == (layout.draft_vocab_size,):
        ids = np.arange(layout.draft_vocab_size) + d2t.astype(np.int64)
        report["target_ids"] = [int(ids.min()), int(ids.max())]
        report["distinct"] = bool(len(np.unique(ids)) == len(ids))
        if ids.min() < 0 or ids.max() >= layout.vocab_size:
            problems.append(
                f"d2t maps draft ids to target ids {report['target_ids']}, outside its "
                f"vocabulary of {layout.vocab_size}"
            )
        elif not report["distinct"]:
            problems.append("d2t maps two draft ids onto one target token")
        elif t2d is not None and (t2d.shape != (layout.vocab_size,) or not t2d[ids].all()
                                  or int(t2d.sum()) != len(ids)):  # fmt: skip
            problems.append("t2d does not mark exactly the target ids d2t maps to")
    elif d2t is not None:
        problems.append(f"d2t has shape {list(d2t.shape)}, not [{layout.draft_vocab_size}]")
    return report, problems


def eagle3_report(source: Source, config: dict[str, Any], target: str | None) -> dict[str, Any]:
    """What `inspect --json` prints for an EAGLE-3 drafter (keys in docs/BLOCK_DRAFTERS.md)."""
    layout = Eagle3Layout.of(config, source.describe())
    tensors, problems = read_headers(source)
    own = {tensor_name(n): t for n, t in tensors.items() if tensor_name(n) is not None}
    shared = sorted(n for n in own if layout.shared(n))
    own = {n: t for n, t in own.items() if not layout.shared(n)}

    def problem(code: str, message: str) -> None:
        problems.append({"code": code, "message": message})

    for message in layout.intrinsic_problems():
        problem("drafter_config", message)
    if not tensors and not problems:
        bins = sorted(n for n in source.files if n.endswith(".bin"))
        hint = f" ({bins[0]} only: mtpkit reads safetensors)" if bins else ""
        problem("no_weights", f"{source.describe()} has no safetensors weights{hint}")
    elif (missing := tensor_problem(layout, own)) is not None:
        problem("drafter_tensors", missing)
    fc = own.get("fc.weight")
    width = 3 * layout.target_hidden_size
    quantized = any(n.endswith(".scales") for n in own)
    if fc is not None and not quantized and fc.shape[-1] != width:
        problem("drafter_fc", f"fc.weight takes {fc.shape[-1]} features, not the 3 x "
                              f"{layout.target_hidden_size} of its target's hidden states")  # fmt: skip
    all_names = {n.removeprefix("model."): t for n, t in tensors.items()}
    d2t_report, vocab_problems = vocabulary(
        layout, read_map(source, own.get("d2t")), read_map(source, all_names.get("t2d"))
    )
    for message in vocab_problems:
        problem("drafter_vocabulary", message)
    pairing, layers = None, None
    if target is not None:
        text = target_text_config(target)
        layers = text.get("num_hidden_layers")
        pairing = {"target": target, "problems": layout.target_problems(text)}
        for message in pairing["problems"]:
            problem("another_target", f"not a drafter for {target}: {message}")
    ids = layout.target_layer_ids
    if ids is None and isinstance(layers, int):
        ids = layout.layer_ids(layers)
    return {
        "source": source.spec,
        "revision": source.revision,
        "commit": source.commit,
        "format": "eagle3",
        "drafter": {
            "kind": "eagle3",
            "architecture": (config.get("architectures") or [None])[0],
            "target": {
                "name": _verifier(config),
                "num_hidden_layers": layers,
                "hidden_size": layout.target_hidden_size,
                "vocab_size": layout.vocab_size,
            },
            "target_layer_ids": None if ids is None else list(ids),
            "target_layer_rule": "config" if layout.target_layer_ids else DEFAULT_RULE,
            "draft_vocab_size": layout.draft_vocab_size,
            "vocabulary": _vocabulary_text(layout),
            "d2t": d2t_report,
            "t2d": "t2d" in all_names,
            "layers": layout.num_hidden_layers,
            "norm_before_residual": layout.norm_before_residual,
            "tensor_count": len(own),
            "bytes": sum(t.nbytes for t in own.values()),
            "shared_tensors_left_out": shared,
            "dtypes": dict(sorted(Counter(t.dtype for t in own.values()).items())),
            "quantized": quantized,
        },
        "pairing": pairing,
        "problems": problems,
    }


def _verifier(config: dict[str, Any]) -> str | None:
    """The target a speculators export names (`speculators_config.verifier.name_or_path`)."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) else None


def _vocabulary_text(layout: Eagle3Layout) -> str:
    embedding = "its own embedding" if layout.own_embedding else "the target's embedding"
    if not layout.maps_vocabulary:
        return f"the target's {layout.vocab_size} tokens (own lm_head, {embedding})"
    return (
        f"{layout.draft_vocab_size} of the target's {layout.vocab_size} tokens (own lm_head, "
        f"d2t to target ids, {embedding})"
    )
