"""Whether a checkpoint's metadata agrees with its tensors (for `mtpkit check`).

Two records describe the tensors without being them: config.json's `quantization` entry (which
mlx-lm's loader follows to build each layer) and `mtp/manifest.json` (which the runtime trusts
for the head's conventions). Each function here returns the disagreements as one-line problems;
`check.py` turns them into the `quantization` and `manifest` checks.
"""

from __future__ import annotations

from typing import Any

from mtpkit.check.probes import CONCAT_ORDERS, HIDDEN_VARIANTS
from mtpkit.checkpoint.inspect import Checkpoint
from mtpkit.core.choices import MODE_DEFAULTS
from mtpkit.core.errors import MtpkitError
from mtpkit.core.manifest import MANIFEST_FORMAT, PLAIN, SHIFTED, UNSHIFTED
from mtpkit.families import family_for
from mtpkit.families.base import expert_layout

QUANT_PARAM_KEYS = ("group_size", "bits", "mode")


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's `quantization` dict (top level, or mirrored in `quantization_config`)."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, dict) and "quant_method" not in q and ("bits" in q or "group_size" in q):
            return q
    return None


def layer_params(q: dict[str, Any] | None, path: str) -> dict[str, Any] | bool | None:
    """The params mlx-lm's loader uses for `path`: an override, False, or the default."""
    if q is None:
        return None
    override = q.get(path)
    if override is False:
        return False
    # An override is what mlx-lm passes to `to_quantized` as it is: keys it leaves out take
    # the layer's defaults (affine, the mode's group size and bits), not the top level's.
    base = dict(q) if not isinstance(override, dict) else dict(override)
    mode = base.get("mode") or "affine"
    group, bits = MODE_DEFAULTS.get(mode, (64, 4))
    return {
        "group_size": int(base.get("group_size") or group),
        "bits": int(base.get("bits") or bits),
        "mode": mode,
    }


def _fits(weight_cols: int, scale_cols: int) -> str:
    """The (bits, group_size) pairs a packed weight and its scales are consistent with."""
    fits = [
        f"{bits} bits/group {group}"
        for bits in (2, 3, 4, 5, 6, 8)
        for group in (32, 64, 128)
        if weight_cols * 32 % bits == 0 and weight_cols * 32 // bits == scale_cols * group
    ]
    return " or ".join(fits[:3]) if fits else "no standard bits/group size"


def quantization_problems(ckpt: Checkpoint) -> tuple[list[str], int]:
    """Layers whose packed weight, scales and biases do not fit their recorded params."""
    q = quantization_config(ckpt.config)
    tensors = ckpt.tensors
    layers = sorted(n.removesuffix(".scales") for n in tensors if n.endswith(".scales"))
    problems: list[str] = []
    for name, t in sorted(tensors.items()):
        if (
            name.endswith(".weight")
            and t.dtype == "U32"
            and f"{name.removesuffix('.weight')}.scales" not in tensors
        ):
            problems.append(f"{name} is packed (uint32) but has no .scales")
    if layers and q is None:
        problems.append(
            f"{len(layers)} layers are quantized (first: {layers[0]}) but config.json has no "
            "`quantization` entry"
        )
        return problems, len(layers)
    for path in layers:
        params = layer_params(q, path)
        weight, scales = tensors.get(f"{path}.weight"), tensors[f"{path}.scales"]
        biases = tensors.get(f"{path}.biases")
        if params is False:
            problems.append(f"config.json says {path} is not quantized, but it has .scales")
            continue
        assert isinstance(params, dict)
        bits, group, mode = params["bits"], params["group_size"], params["mode"]
        if weight is None:
            problems.append(f"{path}.scales has no {path}.weight")
            continue
        if weight.dtype != "U32":
            problems.append(f"{path}.weight is {weight.dtype}, not packed uint32, but has .scales")
            continue
        if mode == "affine" and biases is None:
            problems.append(f"{path} is affine-quantized but has no .biases")
        if biases is not None and biases.shape != scales.shape:
            problems.append(
                f"{path}.biases {list(biases.shape)} differs from .scales {list(scales.shape)}"
            )
        if weight.shape[:-1] != scales.shape[:-1] or not weight.shape:
            problems.append(
                f"{path}.weight {list(weight.shape)} and .scales {list(scales.shape)} disagree on rows"
            )
            continue
        in_from_weight = weight.shape[-1] * 32 / bits
        in_from_scales = scales.shape[-1] * group
        if in_from_weight != in_from_scales:
            override = "its override" if isinstance(q.get(path), dict) else "the config default"
            problems.append(
                f"{path}: weight {list(weight.shape)} with scales {list(scales.shape)} fits "
                f"{_fits(weight.shape[-1], scales.shape[-1])}, but {override} says {bits} bits/"
                f"group {group}"
            )
    if q is not None:
        for path, override in q.items():
            if path in QUANT_PARAM_KEYS or not isinstance(override, dict):
                continue
            w = tensors.get(f"{path}.weight")
            if w is not None and f"{path}.scales" not in tensors:
                problems.append(
                    f"config.json quantizes {path} ({override.get('bits')} bits) but its weight is {w.dtype} with no .scales"
                )
    return problems, len(layers)


# -- manifest -----------------------------------------------------------------------------


def head_bits(ckpt: Checkpoint) -> set[int]:
    q = quantization_config(ckpt.config)
    bits = set()
    for t in ckpt.mtp_tensors:
        if t.name.endswith(".scales"):
            params = layer_params(q, t.name.removesuffix(".scales"))
            if isinstance(params, dict):
                bits.add(params["bits"])
    return bits


def manifest_quantization_problems(ckpt: Checkpoint) -> list[str]:
    """Where the manifest's record of the head's quantization disagrees with the tensors."""
    m = ckpt.manifest if isinstance(ckpt.manifest, dict) else {}
    if m.get("format") not in (None, MANIFEST_FORMAT):
        return []
    mtp = ckpt.mtp_tensors
    problems: list[str] = []
    quantized = any(t.name.endswith(".scales") for t in mtp)
    if "mtp_quantization" in m and mtp:
        mq = m["mtp_quantization"]
        if not mq and quantized:
            problems.append("manifest says the head is not quantized but its tensors carry .scales")
        elif isinstance(mq, dict) and mq.get("bits") and not quantized:
            problems.append(
                f"manifest says the head is {mq['bits']}-bit but its tensors are not quantized"
            )
        elif isinstance(mq, dict) and mq.get("bits") and quantized:
            bits = head_bits(ckpt)
            if bits and int(mq["bits"]) not in bits:
                problems.append(
                    f"manifest says the head is {mq['bits']}-bit but the config quantizes it at {sorted(bits)}"
                )
    paths = m.get("mtp_quantization_paths")
    if isinstance(paths, dict) and mtp:
        q = quantization_config(ckpt.config) or {}
        names = {t.name for t in mtp}
        for path, params in sorted(paths.items()):
            if f"{path}.weight" not in names:
                continue
            has_scales = f"{path}.scales" in names
            if bool(params) != has_scales:
                state = "quantized" if params else "not quantized"
                problems.append(
                    f"manifest says {path} is {state} but its tensors {'carry' if has_scales else 'lack'} .scales"
                )
            elif isinstance(params, dict) and isinstance(q.get(path), dict):
                recorded = {k: q[path].get(k) for k in ("bits", "group_size")}
                if recorded != {k: params.get(k) for k in ("bits", "group_size")}:
                    problems.append(
                        f"manifest quantizes {path} as {params} but config.json says {q[path]}"
                    )
    return problems


def manifest_problems(ckpt: Checkpoint) -> list[str]:
    """Where `mtp/manifest.json` disagrees with the tensors or the config."""
    m = ckpt.manifest or {}
    mtp = ckpt.mtp_tensors
    problems: list[str] = []
    if m.get("format") not in (None, MANIFEST_FORMAT):
        return problems  # another tool's manifest: only the norm format is shared
    family = m.get("family")
    if family is not None:
        try:
            recorded = family_for({"model_type": family}).name
        except MtpkitError:
            recorded = str(family)
        if recorded != ckpt.family.name:
            problems.append(
                f"manifest family {family!r} but config model_type is {ckpt.family.name!r}"
            )
    prefix = m.get("prefix")
    if prefix and mtp:
        outside = [t.name for t in mtp if not t.name.startswith(prefix)]
        if outside:
            problems.append(
                f"manifest prefix {prefix!r} but head tensor {outside[0]} lies outside it"
            )
    layers, declared = m.get("num_layers"), ckpt.family.declared_mtp_layers()
    if layers is not None and declared is not None and int(layers) != declared:
        problems.append(f"manifest num_layers={layers} but the config declares {declared}")
    fmt = m.get("rmsnorm_weight_format")
    if fmt is not None and fmt not in (SHIFTED, UNSHIFTED, PLAIN):
        problems.append(
            f"manifest rmsnorm_weight_format {fmt!r} is not one of {SHIFTED}, {UNSHIFTED}, {PLAIN}"
        )
    if fmt == PLAIN and ckpt.family.zero_centred_norms:
        problems.append(f"manifest says plain norms but {ckpt.family.name} norms are zero-centred")
    if m.get("hidden") is not None and m["hidden"] not in HIDDEN_VARIANTS:
        problems.append(
            f"manifest hidden {m['hidden']!r} is not one of {', '.join(HIDDEN_VARIANTS)}"
        )
    if m.get("concat_order") is not None and m["concat_order"] not in CONCAT_ORDERS:
        problems.append(
            f"manifest concat_order {m['concat_order']!r} is not one of {', '.join(CONCAT_ORDERS)}"
        )
    problems.extend(manifest_quantization_problems(ckpt))
    layout = m.get("expert_layout")
    if isinstance(layout, dict):
        layout = layout.get("after", layout.get("output"))
    if isinstance(layout, str) and mtp:
        actual = expert_layout(t.name for t in mtp if ckpt.family.duplicate_of(t.name) is None)
        if actual not in (None, layout):
            problems.append(
                f"manifest expert_layout {layout!r} but the head's experts are {actual!r}"
            )
    return problems
