"""Loading a Gemma 4 assistant at run time, and reading what it drafts from off its target.

The assistant is a model of its own (`mtpkit.families.gemma4_assistant`): a published
checkpoint (bf16, int64 `token_ordering`, the tied head sometimes saved twice) or mtpkit's
conversion of one (`token_ordering` int32, maybe quantized). Either loads strictly here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError
from mtpkit.families import family_for
from mtpkit.families.gemma4 import kv_source_layers
from mtpkit.families.gemma4_assistant import TOKEN_ORDERING, Gemma4Assistant, Gemma4AssistantModel
from mtpkit.mlxlm import batch_keys_values, cache_keys_values, eval_private_arrays
from mtpkit.runtime.headload import load_drafter_weights


def is_assistant(config: dict[str, Any]) -> bool:
    """Whether a config is a Gemma 4 assistant's."""
    try:
        return isinstance(family_for(config), Gemma4Assistant)
    except MtpkitError:
        return False


def read_weights(path: Path, family: Gemma4Assistant) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for shard in sorted(path.glob("*.safetensors")):
        weights.update(mx.load(str(shard)))
    if not weights:
        raise MtpkitError(f"{path} has no safetensors weights: pass the assistant's directory")
    renamed = {}
    for name, array in weights.items():
        new = family.rename_backbone(name)
        if new is not None:
            renamed[new] = array.astype(mx.int32) if new == TOKEN_ORDERING else array
    return renamed


def assistant_directory(spec: str | Path, revision: str | None = None) -> Path | None:
    """The local directory of `spec` (a directory or a Hub repo) when it is a Gemma 4
    assistant, else None; on the Hub only config.json is read before deciding."""
    from mtpkit.checkpoint.source import HubSource, open_source

    source = open_source(str(spec), revision=revision)
    config = source.read_json("config.json")
    if not isinstance(config, dict) or not is_assistant(config):
        return None
    if isinstance(source, HubSource):
        return source.download(["*.json", "*.safetensors"])
    return source.snapshot_dir()


def check_pairs(
    assistant_config: dict[str, Any], target_config: dict[str, Any], names: tuple[str, str]
) -> None:
    """Refuse an assistant that cannot draft for the target (one line naming why)."""
    from mtpkit.families.gemma4_assistant import pairing_problems

    try:
        target = family_for(target_config).pairing()
    except MtpkitError:  # a model type mtpkit has no family for
        target = None
    if target is None or target.get("role") != "target":
        raise MtpkitError(
            f"{names[0]} is a Gemma 4 assistant; it drafts only for a Gemma 4 target, and "
            f"{names[1]} is not one"
        )
    problems = pairing_problems(family_for(assistant_config).pairing() or {}, target)
    if problems:
        raise MtpkitError(
            f"{names[0]} does not pair with {names[1]}: {problems[0]}; use the assistant "
            "published beside this target"
        )


def load_assistant(path: str | Path) -> Gemma4AssistantModel:
    """The assistant in `path` (a directory), weights loaded strictly."""
    path = Path(path).expanduser()
    config_path = path / "config.json"
    if not config_path.exists():
        raise MtpkitError(f"{path} has no config.json: pass the assistant's directory")
    config = json.loads(config_path.read_text())
    family = family_for(config)
    if not isinstance(family, Gemma4Assistant):
        raise MtpkitError(f"{path} is a {family.name} model, not a Gemma 4 assistant")
    weights = read_weights(path, family)
    model = family.build_model()
    load_drafter_weights(model, weights, config, f"the assistant in {path}")
    # Loaded now, on this thread's stream: a lazy load evaluated later on another thread
    # (the server's decoding thread) has no stream there (as `mlx_lm.load`, lazy=False).
    mx.eval(model.parameters())
    eval_private_arrays(model)
    model.eval()
    model.config = config
    return model


@dataclass(frozen=True)
class TargetReader:
    """Where the assistant reads its target: the cache of the last non-shared layer of each
    attention type, the target's embedding and its scale (sqrt of the hidden size)."""

    sources: dict[str, int]  # attention type -> target layer index
    embedding: nn.Module
    embed_scale: float

    @classmethod
    def of(cls, text_config: dict[str, Any], embedding: nn.Module) -> TargetReader:
        hidden = int(text_config["hidden_size"])
        return cls(kv_source_layers(text_config), embedding, hidden**0.5)

    def kv(self, caches: list[Any]) -> dict[str, tuple[mx.array, mx.array]]:
        """The K/V the assistant attends over, oldest entry first."""
        return {kind: cache_keys_values(caches[i]) for kind, i in self.sources.items()}

    def rows_kv(
        self, caches: list[Any]
    ) -> tuple[dict[str, tuple[mx.array, mx.array]], dict[str, mx.array]]:
        """`kv` of a batch's caches (mlx-lm's `BatchKVCache`/`BatchRotatingKVCache`), and
        per attention type where each row's entries start [B] (`batch_keys_values`)."""
        kv, starts = {}, {}
        for kind, i in self.sources.items():
            keys, values, start = batch_keys_values(caches[i])
            kv[kind], starts[kind] = (keys, values), start
        return kv, starts

    def embed(self, tokens: mx.array) -> mx.array:
        """The target's scaled input embedding of `tokens` [B, L] -> [B, L, H_b]."""
        # A Python float keeps the embedding's dtype, as mlx-lm's gemma4 scales its own.
        return self.embedding(tokens) * self.embed_scale
