"""Where a checkpoint's head sits and which MLX runtimes will run it (inspect's `layout` and
`runtimes`), from the files and headers `inspect` reads: what each runtime looks for is in
`mtpkit.core.peers` and MTP_FORMATS.md ("What the MLX runtimes read"), checked by running each
(scripts/run_peers.py) at the versions named here.
"""

from __future__ import annotations

from typing import Any

from mtpkit.checkpoint.headers import HeaderError, parse_header
from mtpkit.checkpoint.inspect import HEAD_UNUSABLE, MLX_VLM_DRAFTER, Checkpoint
from mtpkit.core.manifest import HEAD_WEIGHTS_PATH, MANIFEST_FORMAT
from mtpkit.core.peers import (
    ARTIFACT_SCHEMA_VERSION,
    PEER_FAMILIES,
    PEER_HEAD_FILE,
    PEER_PREFIX,
)

VLLM_MLX_SIDECAR = "model-mtp.safetensors"  # vllm-mlx's add_mtp_weights_qwen3_next.py layout
RAPID_FILES = (PEER_HEAD_FILE, VLLM_MLX_SIDECAR, "mtp/model.safetensors")
MTPLX_FILES = (PEER_HEAD_FILE, HEAD_WEIGHTS_PATH, VLLM_MLX_SIDECAR)
# Why MTPLX, Rapid-MLX and vllm-mlx cannot run an inline head (they pin mlx-lm 0.31).
OLD_MLX_LM = "its mlx-lm 0.31 shifts the backbone norms again when mtp.* keys sit in the shards"
# The families each runtime builds a Qwen-style `mtp.` head for.
QWEN35 = frozenset({"qwen3_5", "qwen3_5_moe"})


def head_layout(ckpt: Checkpoint) -> str:
    """How the head is stored, by whose convention."""
    if ckpt.format == MLX_VLM_DRAFTER:
        return "mlx-vlm drafter (the head alone, mlx-vlm's names)"
    if ckpt.family.standalone:
        return "standalone drafter (a model of its own, run beside its target)"
    mtp = ckpt.mtp_tensors
    if not mtp:
        return "none"
    in_shards = any(t.shard in ckpt.shards for t in mtp)
    manifest = ckpt.manifest if isinstance(ckpt.manifest, dict) else {}
    if manifest.get("format") == MANIFEST_FORMAT:
        where = "inline (also in the model shards)" if in_shards else "sidecar"
        peers = ", ".join(ckpt.peer_files)
        return f"mtpkit {where}" + (f" + {peers} for the MLX runtimes" if peers else "")
    if ckpt.format == "hf" and in_shards:
        return "raw checkpoint (head in the shards)"
    if any(t.shard == VLLM_MLX_SIDECAR for t in mtp):
        return "model-mtp.safetensors in the index (vllm-mlx's Qwen3-Next script)"
    if in_shards:
        return "inline (head in the model shards, community -MTP builds)"
    sidecar = ckpt.sidecars[0]
    if sidecar == HEAD_WEIGHTS_PATH:
        return "vllm-mlx sidecar (mtp/weights.safetensors + mtp/manifest.json)"
    if sidecar == VLLM_MLX_SIDECAR:
        return "model-mtp.safetensors sidecar (vllm-mlx's Qwen3-Next script, MTPLX)"
    return f"MTPLX sidecar ({sidecar})"


def _top_level_mtp_keys(ckpt: Checkpoint) -> bool:
    """Whether a top-level safetensors file holds `mtp.<path>` keys (what mlx-vlm selects)."""
    for name, header in ckpt.headers.items():
        if "/" not in name and any(k.startswith(PEER_PREFIX) for k in header.tensors):
            return True
    for name in ckpt.peer_files:
        if "/" in name:
            continue
        try:
            header = parse_header(
                name,
                ckpt.source.files[name],
                lambda a, n, s=name: ckpt.source.read_bytes_range(s, a, n),
            )
        except HeaderError:
            continue
        if any(k.startswith(PEER_PREFIX) for k in header.tensors):
            return True
    return False


def _head_bits_declared(ckpt: Checkpoint) -> str | None:
    """Why mlx-vlm and MTPLX would build the head's layers with the wrong bits, or None."""
    manifest = ckpt.manifest if isinstance(ckpt.manifest, dict) else {}
    head = manifest.get("mtp_quantization")
    base = ckpt.config.get("quantization")
    if not head or "mtplx_mtp_quantization" in ckpt.config:
        return None
    if isinstance(base, dict) and (base.get("bits"), base.get("group_size")) == (
        head.get("bits"),
        head.get("group_size"),
    ):
        return None
    return (
        f"the head is {head.get('bits')}-bit but config.json declares no "
        "mtplx_mtp_quantization: re-convert with mtpkit"
    )


def _row(runtime: str, version: str, runs: bool, mtp: bool, note: str) -> dict[str, Any]:
    return {"runtime": runtime, "version": version, "runs": runs, "mtp": mtp, "note": note}


def runtimes(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """One row per runtime: does it load the model, does it run the head, and why."""
    family = ckpt.family.name
    codes = {p["code"] for p in ckpt.problems}
    head = bool(ckpt.mtp_tensors) and not codes & HEAD_UNUSABLE
    if ckpt.format == MLX_VLM_DRAFTER:
        return _drafter_rows()
    if ckpt.family.standalone:
        return _assistant_rows(head)
    files = set(ckpt.source.files)
    inline = ckpt.format == "mlx" and any(t.shard in ckpt.shards for t in ckpt.mtp_tensors)
    bits = _head_bits_declared(ckpt)
    peer_file = _top_level_mtp_keys(ckpt)
    rows = [
        _row("mlx-lm", "0.32", True, False, "plain decoding: mlx-lm drops MTP tensors"),
        _row(
            "mtpkit",
            "this",
            True,
            head,
            "mtpkit generate --mtp"
            if head
            else "no head: it drafts with its assistant (--draft-model ASSISTANT)"
            if ckpt.family.pairing()
            else _no_head(ckpt, codes),
        ),
    ]
    vlm_ok = head and family in PEER_FAMILIES and peer_file and bits is None
    if family not in PEER_FAMILIES:
        vlm_not = (
            "no head: its assistant drafts (--draft-model ASSISTANT --draft-kind mtp)"
            if ckpt.family.pairing()
            else f"no MTP drafter for {family}"
        )
    elif not head:
        vlm_not = "no usable MTP head"
    else:
        vlm_not = bits or f"no top-level file with {PEER_PREFIX}* keys (convert with mtpkit)"
    rows.append(
        _row(
            "mlx-vlm",
            "0.7.10",
            True,
            vlm_ok,
            "--draft-model DIR --draft-kind mtp" if vlm_ok else vlm_not,
        )
    )
    mtplx_file = next((f for f in MTPLX_FILES if f in files), None)
    mtplx_ok = head and family in QWEN35 and mtplx_file is not None and not inline and bits is None
    rows.append(
        _row(
            "MTPLX",
            "2.12.2",
            not inline,
            mtplx_ok,
            f"reads {mtplx_file}"
            if mtplx_ok
            else OLD_MLX_LM
            if inline
            else bits or "no head file it reads (mtp.safetensors)",
        )
    )
    rapid_file = next((f for f in RAPID_FILES if f in files), None)
    rapid_ok = head and family in QWEN35 and rapid_file is not None and not inline
    rows.append(
        _row(
            "Rapid-MLX",
            "0.16.10",
            not inline,
            rapid_ok,
            f"--enable-mtp --mtp-sidecar DIR (reads {rapid_file})"
            if rapid_ok
            else OLD_MLX_LM
            if inline
            else "no head file it reads (mtp.safetensors)",
        )
    )
    splits = head and family in PEER_FAMILIES  # mlx_vlm.split_mtp makes its drafter
    rows.append(_vllm_mlx_row(ckpt, vlm_ok, inline, None if splits else vlm_not))
    rows.append(_row("LM Studio (mlx-engine)", "-", True, False, "plain decoding through mlx-lm"))
    return rows


def _no_head(ckpt: Checkpoint, codes: set[str]) -> str:
    if codes & HEAD_UNUSABLE:
        return "no usable head (see problems)"
    return "no MTP head: `mtpkit train-head` trains one"


def _vllm_mlx_row(
    ckpt: Checkpoint, vlm_ok: bool, inline: bool, why_not: str | None
) -> dict[str, Any]:
    """vllm-mlx drafts through mlx-vlm's drafters: the `mlx_vlm.split_mtp` recipe where a
    head of a family mlx-vlm drafts for exists, else `why_not` (no Qwen3.5 recipe for a
    Llama or a head-less directory)."""
    if why_not is not None:
        return _row("vllm-mlx", "0.6.0", not inline, False, OLD_MLX_LM if inline else why_not)
    manifest = ckpt.manifest if isinstance(ckpt.manifest, dict) else {}
    trusted = manifest.get("artifact_schema_version") == ARTIFACT_SCHEMA_VERSION
    note = (
        "--mllm --mllm-draft-model D --mllm-draft-kind mtp, D from python -m "
        "mlx_vlm.split_mtp --model DIR --output D (its text path "
        + ("trusts the manifest's norms" if trusted else "guesses the norms from their means")
        + " but turns MTP off for Qwen3.5)"
    )
    if inline:
        note = OLD_MLX_LM
    return _row("vllm-mlx", "0.6.0", not inline, vlm_ok and not inline, note)


def _drafter_rows() -> list[dict[str, Any]]:
    return [
        _row(
            "mlx-vlm", "0.7.10", True, True, "--draft-model DIR --draft-kind mtp (with its model)"
        ),
        _row(
            "vllm-mlx",
            "0.6.0",
            True,
            True,
            "--mllm --mllm-draft-model DIR --mllm-draft-kind mtp (with its model)",
        ),
        _row("mtpkit", "this", False, False, "a drafter alone, not a model: convert the model"),
    ]


def _assistant_rows(usable: bool) -> list[dict[str, Any]]:
    """A Gemma 4 assistant: a drafter run beside its target, never alone."""
    return [
        _row("mlx-lm", "0.32", False, False, "refuses model_type gemma4_assistant"),
        _row(
            "mtpkit",
            "this",
            usable,
            usable,
            "--draft-model DIR beside its target" if usable else "not usable (see problems)",
        ),
        _row(
            "mlx-vlm",
            "0.7.10",
            usable,
            usable,
            "--draft-model DIR --draft-kind mtp (with its target)",
        ),
        _row("LM Studio (mlx-engine)", "-", False, False, "model type not supported (#323)"),
    ]
