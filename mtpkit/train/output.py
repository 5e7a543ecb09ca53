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
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtpkit.convert.destination import (
    FileSwap,
    claim_output,
    local_source_dir,
    new_directory,
    remove_stale,
)
from mtpkit.convert.writer import read_config, write_config
from mtpkit.core.errors import MtpkitError, more_of
from mtpkit.core.manifest import HEAD_WEIGHTS_PATH, MANIFEST_PATH, head_manifest, write_manifest
from mtpkit.core.peers import (
    PEER_HEAD_FILE,
    declare_for_peers,
    peer_manifest_keys,
    peer_name,
    writes_peer_head,
)
from mtpkit.families import Family, family_for
from mtpkit.families.base import expert_layout
from mtpkit.families.head import MtpHead

HEAD_DIR = str(Path(HEAD_WEIGHTS_PATH).parent)
# A model directory's own head files, left out of the copy (the new head replaces them).
OLD_HEAD_FILES = ("mtp", "mtp.safetensors", "model-mtp.safetensors")
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


class OutputError(MtpkitError):
    """The trained head cannot be written where it was asked to go."""


def check_destination(
    output: Path | None, into: Path | None, force: bool, model: str | None = None
) -> None:
    """Fail before training, not after, on a destination the run could not write (the
    rules of `mtpkit.convert.destination`, as convert and graft apply them) or a model
    whose result `check` would fail."""
    if (output is None) == (into is None):
        raise OutputError("pass exactly one of -o OUT (a new model directory) and --into DIR")
    source = local_source_dir(model) if model is not None else None
    if output is not None:
        claim_output(output, force=force, sources=[source])
        require_writable(output.absolute().parent, f"-o {output}")
    if source is not None:
        refuse_inline_head(source, "MODEL")
    if into is not None:
        if not (into / "config.json").is_file():
            raise OutputError(f"--into {into}: not a model directory (no config.json)")
        # `--into MODEL` itself is fine: the model is read before anything is written, and
        # only the head's files and config.json are replaced, never through a link.
        FileSwap(into).check(install_targets(into))
        if has_head(into) and not force:
            raise OutputError(f"--into {into} already has an MTP head: pass --force to replace it")
        refuse_inline_head(into, "--into")


def require_writable(directory: Path, what: str) -> None:
    """Fail before training, not after it, where the run will write (`-o`'s parent, the
    checkpoint directory): a file in the way, or a directory that takes no new file (read-only,
    not permitted; probed by creating one, which also catches a read-only filesystem as root)."""
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise OutputError(f"{what}: {existing} is a file, not a directory: choose another place")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise OutputError(
            f"{what}: nothing can be written in {existing} ({e.strerror}): choose a "
            "directory you can write"
        ) from None


def has_head(model_dir: Path) -> bool:
    """Whether the directory already has an MTP head: inspect's reading of it (sidecar files,
    inline tensors by the family's own rule), as a graft decides it."""
    from mtpkit.checkpoint.inspect import read_checkpoint

    return bool(read_checkpoint(str(model_dir)).mtp_tensors)


def refuse_inline_head(model_dir: Path, what: str) -> None:
    """A head stored in the model's own shards (a raw checkpoint, an inline conversion)
    would stay beside the new one, and `check` fails a model with two heads."""
    from mtpkit.checkpoint.inspect import read_checkpoint

    inline = sorted(
        {t.shard for t in read_checkpoint(str(model_dir)).mtp_tensors}
        - {n for n in OLD_HEAD_FILES}
        - {f"{HEAD_DIR}/{Path(HEAD_WEIGHTS_PATH).name}"}
    )
    if inline:
        raise OutputError(
            f"{what} {model_dir} keeps an MTP head in {', '.join(inline[:2])}: a trained head "
            "would be a second one; convert it with `mtpkit convert` (head in mtp/) and "
            "train on that"
        )


def head_dtype(embedding: nn.Module) -> str:
    """The dtype to store the head in: the backbone's embedding dtype when it is floating
    (its scales' when quantized), else bfloat16."""
    dtype = getattr(embedding, "scales", embedding.weight).dtype
    return next((name for name, d in DTYPES.items() if d == dtype), "bfloat16")


def head_tensors(head: MtpHead, family: Family, dtype: str) -> dict[str, mx.array]:
    return {
        f"{family.head_prefix}{k}": v.astype(DTYPES[dtype])
        for k, v in tree_flatten(head.parameters())
    }


def training_manifest(
    family: Family,
    config: dict[str, Any],
    tensors: dict[str, mx.array],
    *,
    dtype: str,
    hidden: str,
    training: dict[str, Any],
) -> dict[str, Any]:
    """The sidecar manifest of a trained head (`mtpkit.core.manifest` keys plus `training`)."""
    manifest = head_manifest(
        family,
        model_type=config.get("model_type"),
        source={"spec": training.get("model"), "revision": None, "commit": None},
        num_layers=1,
        layout="sidecar",
        # Trained in mlx's own convention: a weight is what RMSNorm multiplies by.
        shifted={"backbone": [], "mtp": []},
        hidden=hidden,
        expert_layout={"source": None, "output": expert_layout(tensors)},
        mtp_dtype=dtype,
        head_quant={},
        backbone_quant=_backbone_quantization(config),
        dropped=[],
    )
    return {**manifest, "training": training}


def _backbone_quantization(config: dict[str, Any]) -> dict[str, Any] | None:
    q = config.get("quantization")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    return {
        "bits": int(q["bits"]),
        "group_size": int(q["group_size"]),
        "mode": q.get("mode") or "affine",
    }


def _write_sidecar(directory: Path, tensors: dict[str, mx.array], manifest: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(directory / Path(HEAD_WEIGHTS_PATH).name), tensors, {"format": "mlx"})
    write_manifest(directory / Path(MANIFEST_PATH).name, manifest)


def _declared_config(
    model_dir: Path, family: Family, hidden: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's config with one MTP layer declared, any old head's quantization entries
    dropped (the trained head is stored unquantized) and the head declared for the runtimes
    (`mtpkit.core.peers`); and the keys dropped from it."""
    config = read_config(model_dir / "config.json")
    family.declare_mtp(config, 1)
    for key in ("quantization", "quantization_config"):
        if isinstance(config.get(key), dict):
            config[key] = {
                k: v for k, v in config[key].items() if not k.startswith(family.head_prefix)
            }
    dropped = declare_for_peers(
        config,
        family_name=family.name,
        head_prefix=family.head_prefix,
        head_quant={},
        hidden=hidden,
    )
    return config, dropped


def _save_head(path: Path, tensors: dict[str, mx.array]) -> None:
    """`mx.save_safetensors` to exactly `path` (it appends `.safetensors` to other names)."""
    mx.save_safetensors(str(path), tensors, {"format": "mlx"})
    if path.suffix != ".safetensors":
        os.replace(f"{path}.safetensors", path)


def _peer_head(tensors: dict[str, mx.array], family: Family) -> dict[str, mx.array]:
    """The head as the MLX runtimes read it (`mtp.safetensors`, keys `mtp.<path>`)."""
    return {peer_name(k, family.head_prefix): v for k, v in tensors.items()}


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
    check_destination(output, into, force, str(model))
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
    declared, dropped = _declared_config(into if into is not None else model, family, hidden)
    tensors = head_tensors(head, family, dtype)
    unusable = [k for k, v in tensors.items() if not mx.isfinite(v).all().item()]
    if unusable:  # the last guard: a head that never drafts right replaces nothing
        raise OutputError(
            f"the trained head holds NaN or Inf in {dtype} ({unusable[0]}{more_of(unusable)}): "
            f"nothing was written{' and ' + str(into) + ' keeps its head' if into else ''}; "
            "train again with a lower --lr"
        )
    manifest = training_manifest(
        family, config, tensors, dtype=dtype, hidden=hidden, training=training
    )
    manifest.update(peer_manifest_keys(family.name, dropped))
    if into is not None:
        _install(into, family, tensors, manifest, declared)
    else:
        _write_copy(model, output, family, tensors, manifest, declared, force=force)
    return target


def install_targets(into: Path) -> list[Path]:
    """The files `--into` replaces: the sidecar's weights and manifest, then config.json."""
    return [into / HEAD_WEIGHTS_PATH, into / MANIFEST_PATH, into / "config.json"]


def _write_copy(
    model: Path,
    output: Path,
    family: Family,
    tensors: dict[str, mx.array],
    manifest: dict[str, Any],
    config: dict[str, Any],
    *,
    force: bool,
) -> None:
    with new_directory(output.absolute(), force=force) as tmp:
        for item in model.iterdir():
            if item.name in OLD_HEAD_FILES or item.name.startswith("."):
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        write_config(tmp / "config.json", config)
        _write_sidecar(tmp / HEAD_DIR, tensors, manifest)
        if writes_peer_head(family.name):
            _save_head(tmp / PEER_HEAD_FILE, _peer_head(tensors, family))


def _install(
    into: Path,
    family: Family,
    tensors: dict[str, mx.array],
    manifest: dict[str, Any],
    config: dict[str, Any],
) -> None:
    """The head's files written beside their targets in `into` and moved over them, as a
    graft does; a failure leaves `into` as it was."""
    targets = install_targets(into)
    peer = writes_peer_head(family.name)
    remove_stale(targets + ([into / PEER_HEAD_FILE] if peer else []))
    swap = FileSwap(into)
    try:
        _save_head(swap.temp_for(targets[0]), tensors)
        write_manifest(swap.temp_for(targets[1]), manifest)
        if peer:
            _save_head(swap.temp_for(into / PEER_HEAD_FILE), _peer_head(tensors, family))
        write_config(swap.temp_for(targets[2]), config)  # last: it declares the head
        swap.commit()
    except BaseException as e:
        swap.abort()
        if isinstance(e, OSError):
            raise OutputError(
                f"writing the head into {into} failed, nothing was changed: {e}"
            ) from None
        raise
