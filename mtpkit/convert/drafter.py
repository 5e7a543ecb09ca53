"""`mtpkit convert` of a block drafter (DFlash here; EAGLE-3 in `mtpkit.convert.eagle3`): an MLX drafter directory, bf16 (or
`--dtype`), its linear layers quantized with `-q` as a head's are (`--mtp-bits`, else
`--q-bits`; `--keep-mtp-bf16` keeps them whole).

Only the drafter's files are fetched (config.json and its safetensors); tensors it shares
with its target (an embedding or output head some exports carry) are left out. The
directory is written into a temporary sibling and renamed at the end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.convert.plan import Settings
from mtpkit.convert.quant import QuantSpec, dtype_name, is_floating, quantize
from mtpkit.core.errors import MtpkitError
from mtpkit.families.dflash import DFlashLayout, tensor_name, tensor_problem

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def drafter_spec(settings: Settings) -> QuantSpec | None:
    """How the drafter's linear layers are quantized (None: kept in the float dtype)."""
    if settings.quant_predicate is not None:
        raise MtpkitError(
            f"--quant-predicate {settings.quant_predicate} picks layers of a full model; a "
            "block drafter is quantized uniformly: pass -q (and --mtp-bits) instead"
        )
    wanted = settings.quantize or settings.mtp_bits is not None
    if not wanted or settings.keep_mtp_bf16:
        return None
    return QuantSpec.for_mode(settings.mode, settings.mtp_bits or settings.bits, settings.group_size)


def drafter_tensors(
    weights: dict[str, mx.array], settings: Settings, config: dict[str, Any],
    linear: tuple[str, ...], keep: frozenset[str] | tuple[str, ...] = (),
) -> dict[str, mx.array]:  # fmt: skip
    """A drafter's tensors as written: floating ones cast to `--dtype` (default bfloat16), its
    linear layers (names ending in `linear`, 2-D) quantized where `-q` asks and their rows
    divide the group size, tensors named in `keep` (integer vocabulary maps), integer ones
    and a quantized checkpoint's scales and biases as they are. `config` records the
    quantization and dtype."""
    dtype = DTYPES[settings.dtype or "bfloat16"]
    spec = drafter_spec(settings)
    quantized = any(n.endswith(".scales") for n in weights)
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        if name in keep or not is_floating(array.dtype) or name.endswith((".scales", ".biases")):
            out[name] = array
            continue
        array = array.astype(dtype)
        fits = spec is not None and array.ndim == 2 and array.shape[-1] % spec.group_size == 0
        if fits and not quantized and name.endswith(linear):
            prefix = name.removesuffix(".weight")
            out.update({f"{prefix}.{k}": v for k, v in quantize(array, spec).items()})
        else:
            out[name] = array
    if spec is not None and not quantized:
        config["quantization"] = spec.as_config()
    config["torch_dtype"] = dtype_name(dtype)
    return out


def save_drafter(out: Path, config: dict[str, Any], weights: dict[str, mx.array], *,
                 force: bool) -> None:  # fmt: skip
    """`weights` and `config` as an MLX drafter directory at `out`, written into a temporary
    sibling and renamed at the end."""
    from mtpkit.convert.destination import new_directory

    with new_directory(out, force=force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def convert_drafter(kind: str, source_dir: Path, out: Path, settings: Settings, *,
                    force: bool) -> dict[str, Any]:  # fmt: skip
    """Write the MLX drafter of kind `kind` ("dflash", "eagle3") of `source_dir` to `out`."""
    if settings.draft_vocab is not None:
        raise MtpkitError(
            "--draft-vocab subsets an MTP head's lm_head; a block drafter drafts through its "
            "target's (DFlash) or its own draft vocabulary (EAGLE-3): convert without it"
        )
    if kind == "eagle3":
        from mtpkit.convert.eagle3 import convert_eagle3

        return convert_eagle3(source_dir, out, settings, force=force)
    return convert_dflash(source_dir, out, settings, force=force)


def convert_dflash(source_dir: Path, out: Path, settings: Settings, *, force: bool) -> dict[str, Any]:
    """Write the MLX drafter of `source_dir` to `out`; returns what was done (the record
    `ConvertResult.manifest` carries)."""
    config = json.loads((source_dir / "config.json").read_text())
    layout = DFlashLayout.of(config, str(source_dir))
    problems = layout.intrinsic_problems()
    if problems:
        raise MtpkitError(f"the DFlash drafter in {source_dir} cannot draft: {problems[0]}")
    weights: dict[str, mx.array] = {}
    for shard in sorted(source_dir.glob("*.safetensors")):
        for name, array in mx.load(str(shard)).items():
            if (new := tensor_name(name)) is not None:
                weights[new] = array
    problem = tensor_problem(layout, weights) if weights else "it has no safetensors weights"
    if problem is not None:
        raise MtpkitError(f"the drafter in {source_dir} does not match its config.json: {problem}")
    out_weights = drafter_tensors(weights, settings, config, ("_proj.weight", "fc.weight"))
    record = {
        "drafter": "dflash",
        "source": str(source_dir),
        "dtype": config["torch_dtype"],
        "quantization": config.get("quantization"),
        "tensors": len(out_weights),
        "target_layer_ids": list(layout.target_layer_ids),
    }
    save_drafter(out, config, out_weights, force=force)
    return record
