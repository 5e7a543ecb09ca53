"""Block drafters read without weights: which kind a directory or Hub repo is, and what
`mtpkit inspect` reports of it (its target, the target layers it reads, its block size, its
mask token, its vocabulary mapping, and what is wrong), from config.json and the
safetensors headers alone.

Kinds: DFlash (`mtpkit.families.dflash`, reported here) and EAGLE-3
(`mtpkit.families.eagle3`, reported by `mtpkit.checkpoint.eagle3`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from mtpkit.checkpoint.headers import HeaderError, parse_header
from mtpkit.checkpoint.source import HubSource, Source, open_source
from mtpkit.core.errors import MtpkitError
from mtpkit.families.dflash import DFlashLayout, is_dflash, tensor_name, tensor_problem
from mtpkit.families.eagle3 import is_eagle3

DRAFTER_FILES = ["*.json", "*.safetensors"]  # a drafter's own bytes: never a target's


def drafter_kind(config: Any) -> str | None:
    """"dflash", "eagle3" or None (not a block drafter) for a config.json."""
    if is_dflash(config):
        return "dflash"
    if is_eagle3(config):
        return "eagle3"
    return None


def drafter_directory(spec: str | Path, kind: str, revision: str | None = None) -> Path | None:
    """The local directory of `spec` when it is a block drafter of `kind`, else None; on the
    Hub only config.json is read before deciding, then only the drafter's files fetched."""
    found = block_drafter(spec, revision)
    return found[1] if found is not None and found[0] == kind else None


def block_drafter(spec: str | Path, revision: str | None = None) -> tuple[str, Path] | None:
    """(kind, local directory) of `spec` when it is a block drafter of any kind, else None
    (read and fetched as `drafter_directory` does)."""
    source = open_source(str(spec), revision=revision)
    kind = drafter_kind(source.read_json("config.json"))
    if kind is None:
        return None
    if isinstance(source, HubSource):
        return kind, source.download(DRAFTER_FILES)
    return kind, source.snapshot_dir()


def read_headers(source: Source) -> tuple[dict[str, Any], list[dict[str, str]]]:
    tensors: dict[str, Any] = {}
    problems = []
    for shard in sorted(n for n in source.files if "/" not in n and n.endswith(".safetensors")):
        try:
            header = parse_header(
                shard, source.files[shard], lambda a, n, s=shard: source.read_bytes_range(s, a, n)
            )
        except HeaderError as e:
            problems.append({"code": "corrupt_header", "message": str(e)})
            continue
        tensors.update(header.tensors)
    return tensors, problems


def target_text_config(spec: str) -> dict[str, Any]:
    config = open_source(spec).read_json("config.json")
    if not isinstance(config, dict):
        raise MtpkitError(f"--target {spec} has no config.json: pass the target model's directory")
    return config.get("text_config") or config


def dflash_report(source: Source, config: dict[str, Any], target: str | None) -> dict[str, Any]:
    """What `inspect --json` prints for a DFlash drafter (keys in docs/BLOCK_DRAFTERS.md)."""
    layout = DFlashLayout.of(config, source.describe())
    tensors, problems = read_headers(source)
    own = {tensor_name(n): t for n, t in tensors.items() if tensor_name(n) is not None}

    def problem(code: str, message: str) -> None:
        problems.append({"code": code, "message": message})

    for message in layout.intrinsic_problems():
        problem("drafter_config", message)
    if not tensors and not problems:
        problem("no_weights", f"{source.describe()} has no safetensors weights")
    elif (missing := tensor_problem(layout, own)) is not None:
        problem("drafter_tensors", missing)
    fc = own.get("fc.weight")
    width = len(layout.target_layer_ids) * layout.hidden_size
    if fc is not None and not any(n.endswith(".scales") for n in own) and fc.shape[-1] != width:
        problem(
            "drafter_fc",
            f"fc.weight takes {fc.shape[-1]} features, not the {len(layout.target_layer_ids)} "
            f"target layers x {layout.hidden_size} its config names",
        )
    pairing = None
    if target is not None:
        target_config = target_text_config(target)
        pairing = {"target": target, "problems": layout.target_problems(target_config)}
        for message in pairing["problems"]:
            problem("another_target", f"not a drafter for {target}: {message}")
    dflash = config.get("dflash_config") or {}
    return {
        "source": source.spec,
        "revision": source.revision,
        "commit": source.commit,
        "format": "dflash",
        "drafter": {
            "kind": "dflash",
            "architecture": (config.get("architectures") or [None])[0],
            "target": {
                "num_hidden_layers": layout.num_target_layers,
                "hidden_size": layout.hidden_size,
                "vocab_size": layout.vocab_size,
            },
            "target_layer_ids": list(layout.target_layer_ids),
            "block_size": layout.block_size,
            "max_drafts": layout.max_drafts,
            "mask_token_id": layout.mask_token_id,
            "mask_token": dflash.get("mask_token"),
            "vocabulary": "the target's (embedding and output head shared; no d2t map)",
            "layers": layout.num_hidden_layers,
            "tensor_count": len(own),
            "bytes": sum(t.nbytes for t in own.values()),
            "shared_tensors_left_out": sorted(set(tensors) - {n for n in tensors if tensor_name(n)}),
            "dtypes": dict(sorted(Counter(t.dtype for t in own.values()).items())),
            "quantized": any(n.endswith(".scales") for n in own),
        },
        "pairing": pairing,
        "problems": problems,
    }


def inspect_drafter(spec: str, *, revision: str | None = None,
                    target: str | None = None) -> dict[str, Any] | None:  # fmt: skip
    """The report of a block drafter (None: `spec` is not one)."""
    source = open_source(spec, revision=revision)
    config = source.read_json("config.json")
    kind = drafter_kind(config)
    if kind is None:
        return None
    if kind == "eagle3":
        from mtpkit.checkpoint.eagle3 import eagle3_report

        return eagle3_report(source, config, target)
    return dflash_report(source, config, target)
