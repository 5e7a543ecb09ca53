"""The record of every decision a conversion made, kept beside the MTP head.

mtpkit writes the head to `mtp/weights.safetensors` and this manifest to
`mtp/manifest.json` (the vllm-mlx sidecar layout, whose `rmsnorm_weight_format` key it keeps
for compatibility). Neither file matches `model*.safetensors`, so stock mlx-lm never reads
the head. Later steps (inspect, generate, check, convert again) read these facts instead
of guessing them from tensor statistics, which are known to mislead.

Keys written by `mtpkit convert` (stable; `MANIFEST_KEYS` lists them):

- `format`: always "mtpkit"; `mtpkit_version`: the version that wrote it.
- `family`, `model_type`: mtpkit's family and the config's model_type.
- `source`: `{spec, revision, commit}` of the original checkpoint (kept when an mtpkit
  output is converted again).
- `weights`: the head file beside the manifest ("weights.safetensors").
- `prefix`: the head tensors' name prefix ("language_model.mtp." for Qwen3.5/3.6, "mtp." for
  the others); `num_layers`: MTP layers in the head.
- `layout`: "sidecar" (head only in mtp/) or "inline" (also in the model shards).
- `rmsnorm_weight_format`: "mlx_gamma" (zero-centred norms shifted +1) or "plain".
- `norm_shift`: `{backbone: [keys], mtp: [keys], dtype}`: every tensor mtpkit shifted +1,
  and the dtype the addition was done in ("float32"; null when nothing was shifted).
- `hidden`: "post_norm" or "pre_norm", the hidden state the head expects;
  `concat_order`: "embedding_first" or "hidden_first".
- `expert_layout`: `{source, output}`: "per_expert", "fused", "stacked", "dense".
- `mtp_dtype`: dtype of the head's unquantized tensors; `mtp_quantization`: null or
  `{bits, group_size, mode}` (the setting most head modules use); `mtp_quantization_paths`:
  every quantizable head module path -> false or `{group_size, bits, mode}` (as in
  config.json).
- `backbone_quantization`: null or `{bits, group_size, mode}`, plus `predicate` (mlx-lm's
  mixed recipe, e.g. "mixed_3_6") when one chose the bits per layer.
- `dropped`: source tensors deliberately not written (duplicated embeddings and heads,
  tied lm_head, vision tower, rotary buffers).
- `draft_vocab`: only with `--draft-vocab N`, the ids the head drafts over:
  `{path, size, vocab_size, source ("corpus" or "id_order"), corpus_tokens, corpus_coverage,
  tokenizer_sha256}` (`mtpkit.convert.draft_vocab`).
- `grafted_into`: only after `--mtp-only --into DIR`, the directory grafted into.

`head_manifest` is the one builder of these keys: `mtpkit.convert.records` fills it from a
conversion's plan, `mtpkit.train.output` from a trained head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from mtpkit import __version__

MANIFEST_PATH = "mtp/manifest.json"
HEAD_WEIGHTS_PATH = "mtp/weights.safetensors"
MANIFEST_FORMAT = "mtpkit"

# Head files other tools write; inspect and generate read them too.
SIDECAR_WEIGHTS = (HEAD_WEIGHTS_PATH, "mtp.safetensors", "model-mtp.safetensors")

# `rmsnorm_weight_format` values: `mlx_gamma` means the weight is what mlx-lm's RMSNorm
# multiplies by (zero-centred weights already shifted by +1); `zero_centred` means not yet.
SHIFTED = "mlx_gamma"
UNSHIFTED = "zero_centred"
PLAIN = "plain"

MANIFEST_KEYS = (
    "format",
    "mtpkit_version",
    "family",
    "model_type",
    "source",
    "weights",
    "prefix",
    "num_layers",
    "layout",
    "rmsnorm_weight_format",
    "norm_shift",
    "hidden",
    "concat_order",
    "expert_layout",
    "mtp_dtype",
    "mtp_quantization",
    "mtp_quantization_paths",
    "backbone_quantization",
    "dropped",
    "draft_vocab",
)


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write a manifest (indented JSON, keys in MANIFEST_KEYS order first)."""
    ordered = {k: manifest[k] for k in MANIFEST_KEYS if k in manifest}
    ordered.update({k: v for k, v in manifest.items() if k not in ordered})
    path.write_text(json.dumps(ordered, indent=2) + "\n")


def norm_convention(manifest: dict[str, Any] | None) -> str | None:
    """The norm convention a manifest records, as inspect reports it, or None."""
    if not manifest:
        return None
    fmt = manifest.get("rmsnorm_weight_format")
    return {SHIFTED: "shifted", UNSHIFTED: "zero_centred", PLAIN: "plain"}.get(fmt)


def head_layer_count(head_prefix: str, names: list[str]) -> int:
    """MTP layers present, from the head's tensor names (`{prefix}layers.{i}.`)."""
    prefix = head_prefix + "layers."
    return len({n[len(prefix) :].split(".", 1)[0] for n in names if n.startswith(prefix)})


class HeadFamily(Protocol):
    """What a manifest records of the head's family (`mtpkit.families.Family` has it)."""

    name: str
    head_prefix: str
    zero_centred_norms: bool
    concat_order: str


def head_manifest(
    family: HeadFamily,
    *,
    model_type: str | None,
    source: dict[str, Any],
    num_layers: int,
    layout: str,
    shifted: dict[str, list[str]],
    hidden: str,
    expert_layout: dict[str, str | None],
    mtp_dtype: str | list[str] | None,
    head_quant: dict[str, Any],
    backbone_quant: dict[str, Any] | None,
    dropped: list[str],
) -> dict[str, Any]:
    """A manifest (the keys above, in their order). `shifted` is `{backbone, mtp}`: the
    tensors shifted +1; `head_quant` every quantizable head module -> false or its setting."""
    return {
        "format": MANIFEST_FORMAT,
        "mtpkit_version": __version__,
        "family": family.name,
        "model_type": model_type,
        "source": source,
        "weights": Path(HEAD_WEIGHTS_PATH).name,
        "prefix": family.head_prefix,
        "num_layers": num_layers,
        "layout": layout,
        "rmsnorm_weight_format": SHIFTED if family.zero_centred_norms else PLAIN,
        "norm_shift": {
            "backbone": shifted["backbone"],
            "mtp": shifted["mtp"],
            "dtype": "float32" if (shifted["backbone"] or shifted["mtp"]) else None,
        },
        "hidden": hidden,
        "concat_order": family.concat_order,
        "expert_layout": expert_layout,
        "mtp_dtype": mtp_dtype,
        "mtp_quantization": main_quantization(head_quant),
        "mtp_quantization_paths": head_quant,
        "backbone_quantization": backbone_quant,
        "dropped": dropped,
    }


def main_quantization(paths: dict[str, Any]) -> dict[str, Any] | None:
    """The (bits, group_size, mode) most quantized head modules use, or None."""
    counts: dict[tuple[int, int, str], int] = {}
    for v in paths.values():
        if v:
            key = (v["bits"], v["group_size"], v.get("mode", "affine"))
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    bits, group, mode = max(counts, key=lambda k: counts[k])
    return {"bits": bits, "group_size": group, "mode": mode}

