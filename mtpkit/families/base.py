"""What every model family supplies: data about its MTP head and a few hooks.

A family is built from a checkpoint's `config.json`. Key names are always derived from the
config (the nextn layer of DeepSeek/GLM sits at `model.layers.{num_hidden_layers}`, whatever
that number is), never written as literals.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

EXPERT_INDEX = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+?)(?:\.weight)?$")


# -- conversion hooks (used by mtpkit.convert) ------------------------------------------------

PER_EXPERT = re.compile(
    r"^(?P<mlp>.*\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<part>weight|scales|biases)$"
)
FUSED_GATE_UP = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.gate_up_proj(?:\.weight)?$")
FUSED_DOWN = re.compile(r"^(?P<mlp>.*\.mlp)\.experts\.down_proj(?:\.weight)?$")
# Buffers some checkpoints save that no model uses (precomputed rotary frequencies).
UNUSED_BUFFERS = ("rotary_emb.inv_freq",)


class ConvertHooks:
    """Mixin with the conversion hooks every family shares; families override the data.

    Names go through two steps: `rename` maps a checkpoint name to the name mlx-lm's model
    (backbone) or mtpkit's head file (head) uses, then `transform` (in mtpkit.convert) applies
    the family-independent tensor rules (stack experts, split fused experts, conv1d layout,
    the norm shift). Every rule is keyed on names and shapes, so a converted tensor passes
    through unchanged: converting twice changes nothing.
    """

    # 1-D tensors whose name ends with one of these are zero-centred (shifted +1) in a raw
    # checkpoint; mlx-lm's qwen3_5/qwen3_next sanitize uses this very list for the backbone.
    backbone_norm_suffixes: ClassVar[tuple[str, ...]] = ()
    head_norm_suffixes: ClassVar[tuple[str, ...]] = ()
    # Hybrid families store a depthwise conv1d as [C, 1, K]; mlx wants [C, K, 1].
    has_conv1d: ClassVar[bool] = False

    config: dict[str, Any]
    text_config: dict[str, Any]

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.text_config.get("tie_word_embeddings", self.config.get("tie_word_embeddings", False)))

    def rename_backbone(self, name: str) -> str | None:
        """The mlx-lm parameter name of a backbone tensor, or None to drop it (as mlx-lm does)."""
        if name.endswith(UNUSED_BUFFERS):
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def head_layer(self, name: str) -> tuple[int, str] | None:
        """(MTP layer index, name inside the head) for an MTP tensor, in source naming."""
        raise NotImplementedError

    def rename_head(self, name: str) -> str:
        """The mtpkit head name (`head_prefix` + path) of an MTP tensor."""
        raise NotImplementedError

    def declare_mtp(self, config: dict[str, Any], layers: int) -> None:
        """Write the MTP layer count into `config` in this family's own field."""
        config["num_nextn_predict_layers"] = layers

    def head_module(self, model: Any, layers: int) -> Any:
        """An mlx.nn.Module whose parameter tree is the head's (`layers` MTP layers), rooted at
        `head_prefix`.

        Built from mlx-lm's own layer classes (lazily, nothing is computed), it tells which
        head tensors exist, their shapes, and which modules mlx-lm can quantize.
        """
        raise NotImplementedError

    def split_tensor(self, name: str) -> list[tuple[str, Any]] | None:
        """Family-specific splits of one tensor into several: (new name, function of the
        array) pairs, or None to keep it whole."""
        return None



class Family(ConvertHooks):
    """Base class; one subclass per `model_type` in `mtpkit/families/<model_type>.py`."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    # Zero-centred RMSNorm weights (the model applies 1 + w): Qwen3-Next, Qwen3.5, Qwen3.6.
    zero_centred_norms: ClassVar[bool] = False
    # Order of the two normed inputs to the MTP projection.
    concat_order: ClassVar[str] = "embedding_first"
    # Tensors (other than experts) an MTP layer must have, relative to its layer prefix.
    required_mtp_tensors: ClassVar[tuple[str, ...]] = ()
    # Where the MTP head's tensors live in mtpkit's sidecar, before the head-relative name.
    head_prefix: ClassVar[str] = "mtp."

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.text_config: dict[str, Any] = config.get("text_config") or config

    # -- config facts ------------------------------------------------------------------
    def declared_mtp_layers(self) -> int | None:
        """MTP layers the config declares; None when the config has no such field."""
        value = self.text_config.get("num_nextn_predict_layers")
        if value is None:
            value = self.config.get("num_nextn_predict_layers")
        return None if value is None else int(value)

    def mtp_field(self) -> str:
        """The config field that declares MTP layers for this family."""
        return "num_nextn_predict_layers"

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config["num_hidden_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.text_config.get("num_experts") or self.text_config.get("n_routed_experts") or 0)

    # -- tensor names --------------------------------------------------------------------
    def is_mtp_tensor(self, name: str) -> bool:
        raise NotImplementedError

    def mtp_layer_prefix(self, name: str) -> str | None:
        """The prefix of the MTP layer a tensor belongs to (for grouping and completeness)."""
        raise NotImplementedError

    def duplicate_of(self, name: str) -> str | None:
        """For MTP tensors that copy a backbone tensor, the original's name."""
        return None

    # -- checks ----------------------------------------------------------------------------
    def missing_mtp_tensors(self, names: Iterable[str]) -> list[str]:
        """Required head tensors absent from `names` (one entry per missing tensor)."""
        names = set(names)
        layers = sorted({p for n in names if (p := self.mtp_layer_prefix(n))})
        missing = []
        for layer in layers:
            for rel in self.required_mtp_tensors:
                if f"{layer}{rel}" not in names and f"{layer}{rel}".removesuffix(".weight") not in names:
                    missing.append(f"{layer}{rel}")
        return missing


def expert_layout(names: Iterable[str]) -> str | None:
    """How the MTP head stores its experts, from its tensor names."""
    names = list(names)
    if not names:
        return None
    if any(EXPERT_INDEX.match(n) for n in names):
        return "per_expert"
    if any(n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj") for n in names):
        return "fused"
    if any(".switch_mlp." in n for n in names):
        return "stacked"
    return "dense"


def incomplete_experts(names: dict[str, tuple[int, ...]], num_experts: int) -> list[str]:
    """Messages for expert sets that do not cover 0..num_experts-1 with all projections."""
    problems: list[str] = []
    per_expert: dict[str, dict[str, set[int]]] = {}
    for n in names:
        m = EXPERT_INDEX.match(n)
        if m and m["proj"] in ("gate_proj", "up_proj", "down_proj"):
            per_expert.setdefault(m["prefix"], {}).setdefault(m["proj"], set()).add(int(m["expert"]))
    for prefix, projs in sorted(per_expert.items()):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = projs.get(proj, set())
            missing = sorted(set(range(num_experts)) - have)
            extra = sorted(have - set(range(num_experts)))
            if missing:
                problems.append(
                    f"{prefix}.*.{proj}: {len(missing)} of {num_experts} experts missing "
                    f"(first: {missing[0]})"
                )
            if extra:
                problems.append(f"{prefix}.*.{proj}: expert ids {extra[:3]} exceed num_experts={num_experts}")
    fused = {n.rsplit(".", 1)[0] for n in names if n.endswith("experts.gate_up_proj")}
    fused |= {n.rsplit(".", 1)[0] for n in names if n.endswith("experts.down_proj")}
    for prefix in sorted(fused):
        for part in ("gate_up_proj", "down_proj"):
            shape = names.get(f"{prefix}.{part}")
            if shape is None:
                problems.append(f"{prefix}.{part} missing from the fused experts")
            elif num_experts and shape[0] != num_experts:
                problems.append(f"{prefix}.{part} holds {shape[0]} experts, config says {num_experts}")
    stacked = {n.split(".switch_mlp.")[0] for n in names if ".switch_mlp." in n}
    for prefix in sorted(stacked):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shape = names.get(f"{prefix}.switch_mlp.{proj}.weight")
            if shape is None:
                problems.append(f"{prefix}.switch_mlp.{proj}.weight missing")
            elif num_experts and shape[0] != num_experts:
                problems.append(
                    f"{prefix}.switch_mlp.{proj}.weight holds {shape[0]} experts, config says {num_experts}"
                )
    return problems

