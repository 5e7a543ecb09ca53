"""Where a trained head goes: mtpkit's own sidecar (`mtp/weights.safetensors` and
`mtp/manifest.json`) in a model directory, so `generate`, `bench` and `check` use it as they
use a converted one.

- `-o OUT`: a copy of the model directory (its old head, if any, left out) with the new head
  and the MTP layer declared in `config.json`, written into a temporary sibling of OUT and
  renamed at the end.
- `--into DIR`: the head installed into an existing conversion of the same model: `mtp/` is
  built in a temporary sibling and renamed into place, `config.json` replaced atomically; an
  existing head is replaced only with `force`.

The manifest carries the keys `mtpkit convert` writes (`mtpkit.core.manifest`) plus `training`:
how the head was made (settings, data, initialisation, steps, held-out acceptance).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mtpkit import __version__
from mtpkit.convert.writer import read_config, write_config
from mtpkit.core.errors import MtpkitError
from mtpkit.core.manifest import (
    HEAD_WEIGHTS_PATH,
    MANIFEST_FORMAT,
    MANIFEST_PATH,
    PLAIN,
    SHIFTED,
    write_manifest,
)
from mtpkit.core.peers import (
    PEER_HEAD_FILE,
    declare_for_peers,
    peer_manifest_keys,
    peer_name,
    writes_peer_head,
)
from mtpkit.families import Family, family_for
from mtpkit.families.head import MtpHead

# A model directory's own head files, left out of the copy (the new head replaces them).
OLD_HEAD_FILES = ("mtp", "mtp.safetensors", "model-mtp.safetensors")
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


class OutputError(MtpkitError):
    """The trained head cannot be written where it was asked to go."""


def check_destination(output: Path | None, into: Path | None, force: bool) -> None:
    """Fail before training, not after, on a destination the run could not write."""
    if (output is None) == (into is None):
        raise OutputError("pass exactly one of -o OUT (a new model directory) and --into DIR")
    if output is not None and output.exists() and not force:
        raise OutputError(f"{output} exists: pass --force to replace it")
    if into is not None:
        if not (into / "config.json").is_file():
            raise OutputError(f"--into {into}: not a model directory (no config.json)")
        if has_head(into) and not force:
            raise OutputError(f"--into {into} already has an MTP head: pass --force to replace it")


def has_head(model_dir: Path) -> bool:
    """Whether the directory already has an MTP head: inspect's reading of it (sidecar files,
    inline tensors by the family's own rule), as a graft decides it."""
    from mtpkit.checkpoint.inspect import read_checkpoint

    return bool(read_checkpoint(str(model_dir)).mtp_tensors)


def head_dtype(model: Any) -> str:
    """The dtype to store the head in: the backbone's embedding dtype when it is floating
    (its scales' when quantized), else bfloat16."""
    embed = model.language_model.model if hasattr(model, "language_model") else model.model
    table = embed.embed_tokens
    dtype = getattr(table, "scales", table.weight).dtype
    return next((name for name, d in DTYPES.items() if d == dtype), "bfloat16")


def head_tensors(head: MtpHead, family: Family, dtype: str) -> dict[str, mx.array]:
    return {
        f"{family.head_prefix}{k}": v.astype(DTYPES[dtype])
        for k, v in tree_flatten(head.parameters())
    }


def training_manifest(
    family: Family, config: dict[str, Any], *, dtype: str, hidden: str, training: dict[str, Any]
) -> dict[str, Any]:
    """The sidecar manifest of a trained head (`mtpkit.core.manifest` keys plus `training`)."""
    return {
        "format": MANIFEST_FORMAT,
        "mtpkit_version": __version__,
        "family": family.name,
        "model_type": config.get("model_type"),
        "source": {"spec": training.get("model"), "revision": None, "commit": None},
        "weights": Path(HEAD_WEIGHTS_PATH).name,
        "prefix": family.head_prefix,
        "num_layers": 1,
        "layout": "sidecar",
        # Trained in mlx's own convention: a weight is what RMSNorm multiplies by.
        "rmsnorm_weight_format": SHIFTED if family.zero_centred_norms else PLAIN,
        "norm_shift": {"backbone": [], "mtp": [], "dtype": None},
        "hidden": hidden,
        "concat_order": family.concat_order,
        "expert_layout": {"source": None, "output": "dense"},
        "mtp_dtype": dtype,
        "mtp_quantization": None,
        "mtp_quantization_paths": {},
        "backbone_quantization": _backbone_quantization(config),
        "dropped": [],
        "training": training,
    }


def _backbone_quantization(config: dict[str, Any]) -> dict[str, int] | None:
    q = config.get("quantization")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    return {"bits": int(q["bits"]), "group_size": int(q["group_size"])}


def _write_sidecar(directory: Path, tensors: dict[str, mx.array], manifest: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / Path(HEAD_WEIGHTS_PATH).name), tensors, {"format": "mlx"})
    write_manifest(directory / Path(MANIFEST_PATH).name, manifest)


def _declared_config(
    model_dir: Path, family: Family, hidden: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The directory's config.json with the head declared (for the runtimes too,
    `mtpkit.core.peers`), and the keys dropped from it."""
    config = read_config(model_dir / "config.json")
    family.declare_mtp(config, 1)
    dropped = declare_for_peers(
        config,
        family_name=family.name,
        head_prefix=family.head_prefix,
        head_quant={},
        hidden=hidden,
    )
    return config, dropped


def _write_peer_head(path: Path, tensors: dict[str, mx.array], family: Family) -> None:
    """The head again as the MLX runtimes read it (`mtp.safetensors`, keys `mtp.<path>`)."""
    peer = {peer_name(k, family.head_prefix): v for k, v in tensors.items()}
    mx.save_safetensors(str(path), peer, {"format": "mlx"})


def write_trained_head(
    model: Path,
    head: MtpHead,
    *,
    output: Path | None = None,
    into: Path | None = None,
    force: bool = False,
    dtype: str | None = None,
    hidden: str,
    training: dict[str, Any],
) -> Path:
    """Write the head as a sidecar into a copy of `model` (`output`) or into `into`;
    returns the model directory that now holds it."""
    check_destination(output, into, force)
    config = read_config(model / "config.json")
    family = family_for(config)
    dtype = dtype or "bfloat16"
    target = into if into is not None else output
    assert target is not None
    target_config = read_config(target / "config.json") if into is not None else config
    if into is not None and family_for(target_config).name != family.name:
        raise OutputError(
            f"--into {into} is a {family_for(target_config).name} model, the head is {family.name}"
        )
    manifest = training_manifest(family, config, dtype=dtype, hidden=hidden, training=training)
    declared, dropped = _declared_config(into if into is not None else model, family, hidden)
    manifest.update(peer_manifest_keys(family.name, dropped))
    tensors = head_tensors(head, family, dtype)
    if into is not None:
        _install(into, family, tensors, manifest, declared)
    else:
        _write_copy(model, output, family, tensors, manifest, declared)
    return target


def _write_copy(
    model: Path,
    output: Path,
    family: Family,
    tensors: dict[str, mx.array],
    manifest: dict[str, Any],
    config: dict[str, Any],
) -> None:
    output = output.absolute()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        for item in model.iterdir():
            if item.name in OLD_HEAD_FILES or item.name.startswith("."):
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        write_config(tmp / "config.json", config)
        _write_sidecar(tmp / "mtp", tensors, manifest)
        if writes_peer_head(family.name):
            _write_peer_head(tmp / PEER_HEAD_FILE, tensors, family)
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old.", dir=output.parent))
            os.replace(output, old / output.name)
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _install(
    into: Path,
    family: Family,
    tensors: dict[str, mx.array],
    manifest: dict[str, Any],
    config: dict[str, Any],
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".mtp.", dir=into))
    config_tmp = into / f".config.json.{os.getpid()}.tmp"
    # Named *.safetensors: mx.save_safetensors appends the suffix to any other name.
    peer_tmp = into / f".peer-head.{os.getpid()}.safetensors"
    old = None
    try:
        _write_sidecar(tmp, tensors, manifest)
        write_config(config_tmp, config)
        if writes_peer_head(family.name):
            _write_peer_head(peer_tmp, tensors, family)
        if (into / "mtp").exists():
            old = Path(tempfile.mkdtemp(prefix=".mtp.old.", dir=into))
            os.replace(into / "mtp", old / "mtp")
        os.replace(tmp, into / "mtp")
        if peer_tmp.exists():
            os.replace(peer_tmp, into / PEER_HEAD_FILE)
        os.replace(config_tmp, into / "config.json")
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
        config_tmp.unlink(missing_ok=True)
        peer_tmp.unlink(missing_ok=True)
