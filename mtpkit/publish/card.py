"""The model card (README.md) of an uploaded conversion: what a user needs to run it.

Front matter the Hub shows (`library_name: mlx`, tags `mlx`, `mtp`, `base_model`), then the
source (repo and revision), the MTP head and how it is stored (read from the manifest, the
record of facts), the runtimes that run it with the exact commands, and the `mtpkit check`
verdict with its acceptance.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mtpkit import __version__
from mtpkit.core.peers import PEER_HEAD_FILE, writes_peer_head

HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PROMPT = "Write a haiku about the sea."


# The card's last line: a README.md holding it is mtpkit's own card, which an upload writes
# again; any other README.md in the directory is the user's and is never overwritten.
CARD_MARK = "<!-- written by mtpkit upload; a README.md without this line is kept as it is -->"


def is_mtpkit_card(text: str) -> bool:
    return CARD_MARK in text


def hub_source(spec: str | None) -> str | None:
    """The source's Hub repo id, or None for a local directory."""
    if not spec or Path(spec).expanduser().exists() or not HUB_REPO.match(spec):
        return None
    return spec


def _front_matter(base: str | None) -> str:
    lines = ["---", "library_name: mlx", "pipeline_tag: text-generation", "tags:"]
    lines += ["- mlx", "- mtp", "- mtpkit", "- speculative-decoding"]
    if base:
        lines.append(f"base_model: {base}")
    return "\n".join(lines + ["---", ""])


def _quantization(manifest: dict[str, Any]) -> str:
    head = manifest.get("mtp_quantization")
    backbone = manifest.get("backbone_quantization")
    head_text = (
        f"{head['bits']}-bit, group {head['group_size']}"
        if head
        else f"unquantized ({manifest.get('mtp_dtype')})"
    )
    backbone_text = (
        f"{backbone['bits']}-bit, group {backbone['group_size']}" if backbone else "unquantized"
    )
    return f"head {head_text}; backbone {backbone_text}"


def _head_table(manifest: dict[str, Any]) -> str:
    shift = manifest.get("norm_shift") or {}
    shifted = len(shift.get("mtp") or []) + len(shift.get("backbone") or [])
    norms = manifest.get("rmsnorm_weight_format")
    if shifted:
        norms = f"{norms} ({shifted} zero-centred norms shifted +1 once, in {shift.get('dtype')})"
    files = "`mtp/weights.safetensors` + `mtp/manifest.json` (mtpkit's record)"
    if PEER_HEAD_FILE in (manifest.get("peer_files") or {}):
        files += f"; the same tensors as `{PEER_HEAD_FILE}` (keys `mtp.*`, for the runtimes below)"
    rows = [
        ("family", f"{manifest.get('family')} (model_type {manifest.get('model_type')})"),
        ("MTP layers", str(manifest.get("num_layers"))),
        ("stored in", files),
        ("precision", _quantization(manifest)),
        ("norm convention", str(norms)),
        ("hidden state fed to the head", str(manifest.get("hidden"))),
        ("concat order", str(manifest.get("concat_order"))),
        ("expert layout", str((manifest.get("expert_layout") or {}).get("output"))),
    ]
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def run_commands(repo: str, family: str) -> list[tuple[str, str, str]]:
    """(runtime, what it runs, exact command) for a conversion published as `repo`."""
    rows = [
        (
            "mlx-lm 0.32",
            "plain decoding (mlx-lm drops the head)",
            f'mlx_lm.generate --model {repo} --prompt "{PROMPT}"',
        ),
        (
            f"mtpkit {__version__}",
            "MTP",
            f'mtpkit generate --model {repo} --mtp --prompt "{PROMPT}"',
        ),
    ]
    if writes_peer_head(family):
        rows += [
            (
                "mlx-vlm 0.7.10",
                "MTP (its drafter, one draft per round)",
                f"python -m mlx_vlm.generate --model {repo} --draft-model {repo} "
                f'--draft-kind mtp --draft-block-size 2 --prompt "{PROMPT}" --temperature 0',
            ),
            (
                "MTPLX 2.12.2",
                "MTP",
                f'mtplx run --model {repo} --mtp "{PROMPT}"',
            ),
            (
                "Rapid-MLX 0.16.10",
                "MTP",
                f"rapid-mlx serve {repo} --enable-mtp --mtp-sidecar {repo}",
            ),
            (
                "vllm-mlx 0.6.0",
                "MTP through an mlx-vlm drafter",
                f"python -m mlx_vlm.split_mtp --model {repo} --output drafter && vllm-mlx serve "
                f"{repo} --mllm --mllm-draft-model drafter --mllm-draft-kind mtp "
                "--default-mllm-draft",
            ),
        ]
    rows.append(("LM Studio (mlx-engine)", "plain decoding (no MTP)", ""))
    return rows


def _check_section(check: dict[str, Any] | None) -> str:
    if check is None:
        return "`mtpkit check` was not run on this upload."
    line = f"`mtpkit check` verdict before upload: **{check['verdict']}**"
    if check.get("acceptance") is not None:
        line += (
            f", greedy acceptance of the head as shipped {100 * check['acceptance']:.1f}% "
            "(depth 1, the built-in probe prompts)"
        )
    rows = [f"| {c['name']} | {c['status']} | {c['detail']} |" for c in check["checks"]]
    table = "\n".join(["| check | status | detail |", "|---|---|---|", *rows])
    return f"{line}.\n\n{table}"


def model_card(repo: str, manifest: dict[str, Any], check: dict[str, Any] | None = None) -> str:
    """README.md for `repo`, from the conversion's manifest and its `mtpkit check` result."""
    source = manifest.get("source") or {}
    base = hub_source(source.get("spec"))
    where = f"[{base}](https://huggingface.co/{base})" if base else "a local checkpoint"
    pinned = source.get("commit") or source.get("revision")
    if pinned:
        where += f" at revision `{pinned}`"
    commands = "\n".join(
        f"| {runtime} | {what} | " + (f"`{command}`" if command else "from its model search") + " |"
        for runtime, what, command in run_commands(repo, str(manifest.get("family")))
    )
    return "\n".join(
        [
            _front_matter(base),
            f"# {repo}",
            "",
            f"Converted to MLX from {where} with mtpkit {__version__}, keeping its "
            "multi-token-prediction (MTP) head. The backbone is what `mlx_lm.convert` writes; "
            "the head sits beside it.",
            "",
            "## The MTP head",
            "",
            _head_table(manifest),
            "",
            "## Run it",
            "",
            "| runtime | runs | command |",
            "|---|---|---|",
            commands,
            "",
            "## Check",
            "",
            _check_section(check),
            "",
            f"Re-check it any time: `mtpkit check {repo}` (add `--probe` to measure acceptance).",
            "",
            CARD_MARK,
            "",
        ]
    )
