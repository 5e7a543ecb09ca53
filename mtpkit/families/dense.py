"""Plain dense decoders that ship no MTP head (Llama, Mistral, Qwen2, Qwen3): the head
`mtpkit train-head` gives them.

It has the DeepSeek/Qwen-Next form: two RMSNorms, `fc` over [embedding; hidden], one decoder
block of the model's own mlx-lm layer class, a final norm, and the backbone's embedding and
lm_head. Names follow Qwen's (`mtp.fc.weight`, `mtp.pre_fc_norm_embedding.weight`, ...), kept
under `mtp.` in the sidecar. Norms are plain (never zero-centred), so nothing is ever shifted.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.nn as nn

from mtpkit.families.base import Family
from mtpkit.families.head import QWEN_REQUIRED, MtpHead, QwenHead


class DenseHead(QwenHead):
    """Qwen's head roles around layers of a block built from `args` alone
    (`TransformerBlock(args)` in mlx-lm's llama, qwen2 and qwen3)."""

    def __init__(self, args: Any, block: type[nn.Module], num_layers: int) -> None:
        MtpHead.__init__(self)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.norm = nn.RMSNorm(h, eps=eps)
        self.layers = [block(args) for _ in range(num_layers)]


class DenseFamily(Family):
    """A dense decoder whose head, when it has one, was trained by `mtpkit train-head`."""

    ships_head = False
    required_mtp_tensors = QWEN_REQUIRED
    raw_head_roots: ClassVar[tuple[str, ...]] = ("mtp.",)
    head_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)
    head_class: ClassVar[type[MtpHead]] = DenseHead
    block_class = "TransformerBlock"
