"""What the MLX runtimes users already have read, so that a conversion runs in them unchanged.

mtpkit's own record stays `mtp/weights.safetensors` + `mtp/manifest.json` (`manifest.py`).
Next to it a conversion declares the same facts where each peer looks for them (each checked
by running the peer, MTP_FORMATS.md "What the MLX runtimes read"):

- mlx-vlm 0.7.10 (`--draft-kind mtp`), Rapid-MLX 0.16.10 and MTPLX 2.12.2 read a top-level
  `mtp.safetensors` whose keys are `mtp.<path>`; its `format: mlx` metadata tells mlx-vlm the
  norms are already in mlx's convention (it adds +1 otherwise). Written for the families whose
  head these runtimes build (`PEER_FAMILIES`). Stock mlx-lm never reads it (not `model*`).
- A quantized head whose bits or group size are not the backbone's (`--mtp-bits`, 8-bit
  routers): `mtplx_mtp_quantization` in config.json, `{bits, group_size, mode}` plus one
  `mtp.<path>` entry per module that differs from those (MTPLX and mlx-vlm build the head's
  layers from it; without it they take the backbone's bits and fail on the shapes).
- vllm-mlx 0.6.0 reads `mtp/weights.safetensors` and trusts the manifest's
  `rmsnorm_weight_format` only beside `"artifact_schema_version": 1` (else it adds +1 to every
  head norm whose mean is below 0.5, which the `pre_fc_norm_*` gammas are in both
  conventions); it feeds the hidden state config.json's `mtp_hidden_state_mode` names.
- config.json's `auto_map` makes transformers (under `mlx_lm.load`) ask "Do you wish to run the
  custom code?" on stdin; mlx-lm's model classes never need it, so it is dropped and recorded
  in the manifest's `config_dropped`.
"""

from __future__ import annotations

from typing import Any

# The head file the peers read, and the prefix of its keys.
PEER_HEAD_FILE = "mtp.safetensors"
PEER_PREFIX = "mtp."
# Families whose head the peers build from `mtp.<path>` keys (the Qwen3.5/3.6/Next `mtp.` tree).
PEER_FAMILIES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next"})
# vllm-mlx trusts `rmsnorm_weight_format` only in a manifest of this schema version.
ARTIFACT_SCHEMA_VERSION = 1
# config.json keys that make a loader run (or ask to run) code from the model directory.
REMOTE_CODE_KEYS = ("auto_map",)
# The config.json keys this module owns (recomputed on every conversion, graft and training).
PEER_CONFIG_KEYS = ("mtplx_mtp_quantization", "mtp_hidden_state_mode")


def writes_peer_head(family_name: str) -> bool:
    """Whether a conversion of this family also writes `mtp.safetensors`."""
    return family_name in PEER_FAMILIES


def peer_name(name: str, head_prefix: str) -> str:
    """A head tensor's name in `mtp.safetensors` (`language_model.mtp.fc.weight` -> `mtp.fc.weight`)."""
    if not name.startswith(head_prefix):
        raise ValueError(f"{name} is not a head tensor under {head_prefix!r}")
    return PEER_PREFIX + name[len(head_prefix) :]


def peer_quantization(
    config_quant: dict[str, Any] | None, head_quant: dict[str, Any], head_prefix: str
) -> dict[str, Any] | None:
    """`mtplx_mtp_quantization` for a head quantized as `head_quant` (module path -> False or
    {group_size, bits}), or None when the peers need nothing beyond config's `quantization`."""
    quantized = {p: v for p, v in head_quant.items() if isinstance(v, dict) and v.get("bits")}
    if not quantized:
        return None
    counts: dict[tuple[int, int], int] = {}
    for v in quantized.values():
        key = (int(v["bits"]), int(v["group_size"]))
        counts[key] = counts.get(key, 0) + 1
    bits, group = max(counts, key=lambda k: (counts[k], k))
    mode = (config_quant or {}).get("mode", "affine")
    overrides = {
        peer_name(p, head_prefix): {"group_size": int(v["group_size"]), "bits": int(v["bits"])}
        for p, v in sorted(quantized.items())
        if (int(v["bits"]), int(v["group_size"])) != (bits, group)
    }
    base = config_quant or {}
    if (base.get("bits"), base.get("group_size")) == (bits, group) and not overrides:
        return None
    return {"group_size": group, "bits": bits, "mode": mode, **overrides}


def declare_for_peers(
    config: dict[str, Any],
    *,
    family_name: str,
    head_prefix: str,
    head_quant: dict[str, Any],
    hidden: str | None,
) -> dict[str, Any]:
    """Add to `config` (in place) what the peers read about the head, replacing any earlier
    declaration, and drop the keys that would make a loader ask to run remote code. Returns the
    dropped keys with their values (the manifest's `config_dropped`)."""
    dropped = {k: config.pop(k) for k in REMOTE_CODE_KEYS if k in config}
    for key in PEER_CONFIG_KEYS:
        config.pop(key, None)
    if not writes_peer_head(family_name):
        return dropped
    quant = peer_quantization(config.get("quantization"), head_quant, head_prefix)
    if quant is not None:
        config["mtplx_mtp_quantization"] = quant
    if hidden is not None:
        config["mtp_hidden_state_mode"] = hidden
    return dropped


def peer_manifest_keys(family_name: str, dropped: dict[str, Any]) -> dict[str, Any]:
    """The manifest keys beside mtpkit's own: vllm-mlx's schema version, the peer file, and
    what was dropped from config.json."""
    keys: dict[str, Any] = {"artifact_schema_version": ARTIFACT_SCHEMA_VERSION}
    if writes_peer_head(family_name):
        keys["peer_files"] = {PEER_HEAD_FILE: PEER_PREFIX}
    if dropped:
        keys["config_dropped"] = dict(sorted(dropped.items()))
    return keys
