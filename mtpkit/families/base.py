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


class Family:
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
