"""Gemma 4 targets (`gemma4`, text-only `gemma4_text`, encoder-free `gemma4_unified`).

Stock mlx-lm 0.32 runs them (`mlx_lm/models/gemma4{,_text}.py`); they ship no MTP head of
their own. Google publishes beside each a small "assistant" drafter
(`mtpkit.families.gemma4_assistant`) that reads the K/V this target caches in the last
non-shared layer of each attention type; `kv_source_layers` says which layers those are and
`pairing` what an assistant must match to pair with this target.

Conversion mirrors mlx-lm's `sanitize` (the wrapper's, then the text model's): the vision
and audio towers dropped, `model.language_model.` moved under `language_model.model.`, the
K/V projections of KV-shared layers (which never compute K/V) dropped.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

from mtpkit.core.errors import MtpkitError
from mtpkit.families.base import Family, register
from mtpkit.families.head import MtpHead

# Towers of the multimodal checkpoints that mlx-lm drops (its gemma4 `Model.sanitize`).
DROPPED_TOWERS = (
    "vision_tower",
    "multi_modal_projector",
    "audio_tower",
    "embed_audio",
    "embed_vision",
    "vision_embedder",
)
# Buffers and clipping statistics mlx-lm's gemma4_text `sanitize` drops.
DROPPED_PARTS = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
SHARED_KV_PARTS = (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")
LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class NoTrainedHead(MtpHead):
    """Gemma 4 drafts with its published assistant, not with an MTP head."""

    @classmethod
    def build(cls, args: Any, block: Any, num_layers: int, names: Any = ()) -> MtpHead:
        raise MtpkitError(
            "Gemma 4 has no MTP head: it drafts with its published assistant "
            "(`mtpkit generate --model TARGET --draft-model ASSISTANT`)"
        )


def text_config_of(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def layer_types(text: dict[str, Any]) -> list[str]:
    """The attention type of every layer, as mlx-lm reads it (its default pattern when the
    config lists none)."""
    types = text.get("layer_types")
    if isinstance(types, list):
        return [str(t) for t in types]
    layers = int(text.get("num_hidden_layers", 0))
    pattern = int(text.get("sliding_window_pattern", 5))
    period = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
    return (period * (layers // len(period) + 1))[:layers]


def kv_source_layers(text: dict[str, Any]) -> dict[str, int]:
    """Attention type -> the last layer of that type that computes its own K/V (the layer
    whose cache the KV-shared layers, and the assistant, read)."""
    types = layer_types(text)
    first_shared = len(types) - int(text.get("num_kv_shared_layers") or 0)
    return {t: i for i, t in enumerate(types[:first_shared])}


def head_dims(text: dict[str, Any]) -> dict[str, int]:
    """The K/V head size per attention type (full layers use `global_head_dim` when set)."""
    head_dim = int(text.get("head_dim", 256))
    return {
        "sliding_attention": head_dim,
        "full_attention": int(text.get("global_head_dim") or head_dim),
    }


def kv_heads(text: dict[str, Any]) -> dict[str, int]:
    """K/V heads per attention type (K-eq-V full layers may have their own count)."""
    heads = int(text.get("num_key_value_heads", 1))
    full = heads
    if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
        full = int(text["num_global_key_value_heads"])
    return {"sliding_attention": heads, "full_attention": full}


@register
class Gemma4(Family):
    name = "gemma4"
    aliases: ClassVar[tuple[str, ...]] = ("gemma4_text", "gemma4_unified")
    ships_head = False
    declared_upstream = False
    head_class: ClassVar[type[MtpHead]] = NoTrainedHead
    mlx_module = "gemma4_text"
    block_class = "DecoderLayer"

    # No tensor of a Gemma 4 target is an MTP head's.
    def is_mtp_tensor(self, name: str) -> bool:
        return False

    def mtp_layer_prefix(self, name: str) -> str | None:
        return None

    def head_relative(self, name: str) -> str | None:
        return None

    @property
    def wrapped(self) -> bool:
        """Multimodal wrapper (`gemma4`, `gemma4_unified`): the text model under
        `language_model`."""
        return self.config.get("model_type") != "gemma4_text"

    def rename_backbone(self, name: str) -> str | None:
        if self.wrapped:
            from_model = name.startswith("model.")
            name = name.removeprefix("model.")
            if name.startswith(DROPPED_TOWERS):
                return None
            if from_model and name.startswith("language_model."):
                name = name.replace("language_model.", "language_model.model.", 1)
        if any(part in name for part in DROPPED_PARTS):
            return None
        if any(part in name for part in SHARED_KV_PARTS):
            m = LAYER_INDEX.search(name)
            if m and int(m[1]) >= self.first_kv_shared_layer:
                return None
        lm_head = "language_model.lm_head.weight" if self.wrapped else "lm_head.weight"
        if self.tie_word_embeddings and name in (lm_head, "lm_head.weight"):
            return None
        return name

    def split_tensor(self, name: str) -> list[tuple[str, Any]] | None:
        """The 26B-A4B's fused experts into mlx-lm's `experts.switch_glu` (its gemma4
        `sanitize`: gate rows first), not the `switch_mlp` other families use."""
        import mlx.core as mx

        if name.endswith(".experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj") + ".switch_glu"
            return [
                (f"{base}.gate_proj.weight", lambda a: mx.contiguous(mx.split(a, 2, axis=-2)[0])),
                (f"{base}.up_proj.weight", lambda a: mx.contiguous(mx.split(a, 2, axis=-2)[1])),
            ]
        if name.endswith(".experts.down_proj"):
            return [(name.removesuffix(".down_proj") + ".switch_glu.down_proj.weight", lambda a: a)]
        return None

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - int(self.text_config.get("num_kv_shared_layers") or 0)

    def text_model(self, model: Any) -> Any:
        return model.language_model if self.wrapped else model

    def args_config(self) -> dict[str, Any]:
        return dict(self.text_config)

    def pairing(self) -> dict[str, Any]:
        """What an assistant must have to draft for this target (`inspect`'s `pairing`)."""
        text = self.text_config
        sources = kv_source_layers(text)
        return {
            "role": "target",
            "hidden_size": int(text.get("hidden_size", 0)),
            "vocab_size": int(text.get("vocab_size", self.config.get("vocab_size", 0))),
            "kv_source_layers": sources,
            "head_dim": head_dims(text),
            "kv_heads": kv_heads(text),
            "sliding_window": int(text.get("sliding_window", 512)),
            "assistant": {
                "backbone_hidden_size": int(text.get("hidden_size", 0)),
                "vocab_size": int(text.get("vocab_size", self.config.get("vocab_size", 0))),
                "layer_types": sorted(sources),
                "head_dim": head_dims(text),
                "attention_heads_multiple_of": math.lcm(*kv_heads(text).values()),
            },
        }
