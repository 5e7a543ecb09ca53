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
  `{bits, group_size}` (the setting most head modules use); `mtp_quantization_paths`: every
  quantizable head module path -> false or `{group_size, bits}` (as in config.json).
- `backbone_quantization`: null or `{bits, group_size}`.
- `dropped`: source tensors deliberately not written (duplicated embeddings and heads,
  tied lm_head, vision tower, rotary buffers).
- `grafted_into`: only after `--mtp-only --into DIR`, the directory grafted into.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
