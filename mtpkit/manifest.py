"""The record of every decision a conversion made, kept beside the MTP head.

mtpkit writes the head to `mtp/weights.safetensors` and this manifest to
`mtp/manifest.json` (the vllm-mlx sidecar layout, whose `rmsnorm_weight_format` key it keeps
for compatibility). Neither file matches `model*.safetensors`, so stock mlx-lm never reads
the head. Later steps (inspect, generate, check, convert again) read these facts instead
of guessing them from tensor statistics, which are known to mislead.
"""

from __future__ import annotations

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


def norm_convention(manifest: dict[str, Any] | None) -> str | None:
    """The norm convention a manifest records, as inspect reports it, or None."""
    if not manifest:
        return None
    fmt = manifest.get("rmsnorm_weight_format")
    return {SHIFTED: "shifted", UNSHIFTED: "zero_centred", PLAIN: "plain"}.get(fmt)
