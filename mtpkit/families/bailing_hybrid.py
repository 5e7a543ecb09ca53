"""Ling-2.5/2.6 and Ring-2.5/2.6 (`bailing_hybrid`): lightning-attention + MLA hybrid.

The MTP layers follow the base ones at `model.layers.{num_hidden_layers + i}` with the names
of Ling-3's (`mtpkit.families.bailing_moe_v3`; vLLM `bailing_moe_mtp.py`, "Bailing MoE
v2.5 MTP"): `enorm`, `hnorm`, `eh_proj`, an MLA attention (`attention.*`, no output gate
here) and a MoE `mlp.*`, `final_layernorm`; embedding and lm_head are the backbone's.
The block is mlx-lm's `DecoderLayer` at its true index (MLA, MoE). As mlx-lm's sanitize
does for the backbone, the router `mlp.gate.weight` becomes `mlp.gate.gate_proj.weight`.

The lightning-attention layers keep a recurrent state that cannot be trimmed:
`mtpkit.runtime.rollback.replay` rolls it back after a rejected draft.
"""

from __future__ import annotations

from mtpkit.families.bailing_moe_v3 import BailingFamily
from mtpkit.families.base import register

ROUTER = ".mlp.gate.weight"
ROUTER_MLX = ".mlp.gate.gate_proj.weight"


def router_name(name: str) -> str:
    """mlx-lm's name of the router weight (its Gate keeps it in a `gate_proj` Linear)."""
    return name.removesuffix(ROUTER) + ROUTER_MLX if name.endswith(ROUTER) else name


@register
class BailingHybrid(BailingFamily):
    name = "bailing_hybrid"
    mlx_module = "bailing_hybrid"
    block_class = "DecoderLayer"

    def rename_backbone(self, name: str) -> str | None:
        renamed = super().rename_backbone(name)
        return None if renamed is None else router_name(renamed)

    def rename_head(self, name: str) -> str:
        return router_name(super().rename_head(name))
