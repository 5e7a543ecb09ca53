"""MTP head modules in MLX, built from mlx-lm's own layer classes.

Every family's head does the same "NextN" step (see docs/MTP_FORMATS.md):

    x = Proj(concat(NormE(embed(t_{k+1})), NormH(h_k)))   # the order is the family's
    x = DecoderBlock(x, mask, own KV cache)
    logits = lm_head(FinalNorm(x))                        # lm_head shared with the backbone

The decoder block is the family's mlx-lm decoder layer class (subclassed only to hang the
projection and norms on it where the checkpoint keeps them inside the layer), so attention,
MoE routing and quantized layers behave exactly as in the backbone. Parameter paths match
the head tensor names with the head prefix (`language_model.mtp.`, `mtp.`) removed.

mlx-lm is imported only inside the methods that run the head, so that conversion, which
builds heads only to read their parameter tree, never pays for `import mlx_lm` (see
`mtpkit.mlxlm.mlx_lm_models`). A family names its head class once; `Family.build_head` builds it for the runtime and
`Family.head_module` roots the very same class at the head prefix for conversion.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.choices import CONCAT_ORDERS, EMBEDDING_FIRST, HIDDEN_FIRST

__all__ = ["CONCAT_ORDERS", "EMBEDDING_FIRST", "HIDDEN_FIRST", "MtpHead"]


class MtpHead(nn.Module):
    """Base class: `layers` plus a table naming the modules of the four roles of the step.

    `roles` maps each role to an attribute path, looked up inside `layers[i]` when
    `roles_in_layer` (DeepSeek, GLM, MiMo) and on the head itself otherwise (Qwen).
    """

    family: str = ""
    roles: ClassVar[dict[str, str]] = {}
    roles_in_layer: ClassVar[bool] = True
    default_concat_order: ClassVar[str] = EMBEDDING_FIRST
    # DeepSeek's MLA attention takes an array mask, never the "causal" shortcut.
    mask_as_array: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        # A plain attribute (not a parameter): which input comes first in the projection.
        self._concat_order = self.default_concat_order

    @classmethod
    def build(
        cls, args: Any, block: type[nn.Module], num_layers: int, names: Iterable[str] = ()
    ) -> MtpHead:
        """The head for mlx-lm `args` with `num_layers` layers of `block`; `names` (the head
        tensors to load, when known) settle optional parameters such as a bias."""
        return cls(args, block, num_layers)

    # -- the four roles ------------------------------------------------------------------
    def role(self, role: str, i: int) -> nn.Module:
        module: Any = self.layers[i] if self.roles_in_layer else self
        for part in self.roles[role].split("."):
            module = getattr(module, part)
        return module

    def norm_embedding(self, i: int) -> nn.Module:
        return self.role("norm_embedding", i)

    def norm_hidden(self, i: int) -> nn.Module:
        return self.role("norm_hidden", i)

    def projection(self, i: int) -> nn.Module:
        return self.role("projection", i)

    def final_norm(self, i: int) -> nn.Module:
        return self.role("final_norm", i)

    # -- the step ------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """MTP layers (steps) in the head: one per entry of `layers` unless a step spans
        several blocks."""
        return len(self.layers)

    @property
    def concat_order(self) -> str:
        return self._concat_order

    def set_concat_order(self, order: str) -> None:
        if order not in CONCAT_ORDERS:
            raise ValueError(f"concat order must be one of {CONCAT_ORDERS}, not {order!r}")
        self._concat_order = order

    def layer_for_step(self, step: int) -> int:
        """Which MTP layer drafts the `step`-th token ahead (vLLM: step % num_layers)."""
        return step % len(self.layers)

    def __call__(
        self,
        hidden: mx.array,
        embedded: mx.array,
        cache: list[Any] | None = None,
        step: int = 0,
    ) -> mx.array:
        """One head step over S positions: the block output, before the final norm.

        `hidden` [B, S, H] is the hidden state at positions k, `embedded` [B, S, H] the
        embedding of the token at k+1. The caller applies `final_norm` and the lm_head.
        """
        from mlx_lm.models.base import create_attention_mask

        i = self.layer_for_step(step)
        e = self.norm_embedding(i)(embedded)
        h = self.norm_hidden(i)(hidden)
        parts = [e, h] if self._concat_order == EMBEDDING_FIRST else [h, e]
        x = self.projection(i)(mx.concatenate(parts, axis=-1))
        layer_cache = cache[i] if cache is not None else None
        mask = create_attention_mask(
            x,
            self.mask_cache(layer_cache),
            window_size=self.window_size(i),
            return_array=self.mask_as_array,
        )
        return self.layers[i](x, mask, layer_cache)

    def mask_cache(self, layer_cache: Any) -> Any:
        """The cache whose offset the attention mask follows (a layer may hold several)."""
        return layer_cache

    def window_size(self, i: int) -> int | None:
        """The sliding window of layer i's attention (None: full attention). The head keeps
        a full KV cache either way; the window lives in the mask, so dropping drafts stays a
        plain trim."""
        return None

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]


# The tensors a Qwen-form head must have (relative to the head), whichever family uses it.
QWEN_REQUIRED = (
    "fc.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
)


class QwenHead(MtpHead):
    """Qwen3.5 / Qwen3.6 / Qwen3-Next: fc + pre_fc_norm_{embedding,hidden} + norm around
    full-attention decoder layers of the backbone's own class."""

    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "pre_fc_norm_embedding",
        "norm_hidden": "pre_fc_norm_hidden",
        "projection": "fc",
        "final_norm": "norm",
    }
    roles_in_layer = False

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.norm = nn.RMSNorm(h, eps=eps)
        self.layers = self.build_layers(args, block, num_layers)

    def build_layers(self, args: Any, block: type[nn.Module], num_layers: int) -> list[nn.Module]:
        """The head's decoder layers. Qwen: the layer index only selects the layer type, the
        last of a full-attention period."""
        full_attention_idx = args.full_attention_interval - 1
        return [block(args, full_attention_idx) for _ in range(num_layers)]


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


def nextn_layer_class(block: type[nn.Module]) -> type[nn.Module]:
    """The family's decoder layer with the nextn projection and norms attached."""

    class NextnLayer(block):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, layer_idx: int) -> None:
            super().__init__(args, layer_idx)
            h, eps = args.hidden_size, args.rms_norm_eps
            self.enorm = nn.RMSNorm(h, eps=eps)
            self.hnorm = nn.RMSNorm(h, eps=eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.shared_head = SharedHead(h, eps)

    NextnLayer.__name__ = f"Nextn{block.__name__}"
    return NextnLayer


class NextnHead(MtpHead):
    """DeepSeek-V3 / GLM-4.5+: enorm, hnorm, eh_proj and shared_head.norm live inside each
    nextn layer, next to a full decoder block of the family's class."""

    roles: ClassVar[dict[str, str]] = {
        "norm_embedding": "enorm",
        "norm_hidden": "hnorm",
        "projection": "eh_proj",
        "final_norm": "shared_head.norm",
    }

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        layer_cls = nextn_layer_class(block)
        # Nextn layers continue the decoder stack, so mlx-lm's own rule (dense below
        # first_k_dense_replace, MoE above) picks their MLP from their true index.
        self.layers = [layer_cls(args, args.num_hidden_layers + i) for i in range(num_layers)]
