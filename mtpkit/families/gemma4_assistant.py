"""Gemma 4's MTP "assistant" (`gemma4_assistant`, also `gemma4_mtp`; the 12B's
`gemma4_unified_assistant`): a standalone drafter that reads its target's KV cache.

One draft step (transformers' `Gemma4AssistantForCausalLM` and its
`SinglePositionMultiTokenCandidateGenerator`):

    x = pre_projection(concat([target_embed(token) * sqrt(H_b), hidden]))   # this order
    x = 4 query-only layers over the K/V of the target's last non-shared layer of the
        same type (sliding or full), bidirectional over the valid entries, the query at a
        constant position: the index of `token` (the target's cache length)
    h = norm(x); logits = own embed_tokens as the output head (dense, or centroid-masked)
    hidden' = post_projection(h)                                   # the next step's hidden

`hidden` is the target's final-normed hidden state at the position before `token`. The
layers are mlx-lm's own gemma4 `DecoderLayer`s: with every layer KV-shared, they compute no
K/V and attend over the `shared_kv` they are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from mtpkit.families.base import Family, register
from mtpkit.families.gemma4 import NoTrainedHead, head_dims, layer_types
from mtpkit.families.head import MtpHead
from mtpkit.mlxlm import mlx_lm_models

TOKEN_ORDERING = "masked_embedding.token_ordering"
# Tensors every assistant has (the layers' are checked per layer).
REQUIRED = ("pre_projection.weight", "post_projection.weight", "model.norm.weight")
LAYER_REQUIRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "post_feedforward_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
KV = Mapping[str, tuple[mx.array, mx.array]]


def assistant_text_args(config: Mapping[str, Any]) -> Any:
    """mlx-lm's gemma4_text ModelArgs for the assistant's `text_config`, with transformers'
    defaults where mlx-lm's differ (every layer KV-shared, no per-layer inputs, no double-wide
    MLP, no soft-capping: `Gemma4AssistantConfig.validate_architecture`)."""
    text = dict(config.get("text_config") or {})
    layers = int(text.get("num_hidden_layers", 4))
    text["num_kv_shared_layers"] = text.get("num_kv_shared_layers") or layers
    text.setdefault("hidden_size_per_layer_input", 0)
    text.setdefault("vocab_size_per_layer_input", 0)
    text.setdefault("use_double_wide_mlp", False)
    text.setdefault("final_logit_softcapping", None)
    text["layer_types"] = layer_types(text)
    return mlx_lm_models("gemma4_text").ModelArgs.from_dict(text)


class MaskedEmbedding(nn.Module):
    """The centroid-masked output head of the E2B/E4B assistants: the hidden state scores
    `num_centroids` token clusters, and only the tokens of the top `top_k` clusters get
    logits from the tied table; every other token gets (smallest of those) - 1."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = nn.Linear(hidden, centroids, bias=False)
        # Which tokens each cluster holds (cluster c: entries c*V/C .. (c+1)*V/C). Published as
        # int64; int32 indexes MLX arrays and is never quantized.
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self.top_k = top_k
        self.vocab = vocab
        self.freeze(keys=["token_ordering"], recurse=False)

    def selected(self, h: mx.array, table: nn.Module) -> tuple[mx.array, mx.array]:
        """(token ids [..., k*V/C], their logits) of the top clusters; `table` is the tied
        embedding (its rows are gathered, dequantized when quantized)."""
        scores = self.centroids(h)
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :]
        clusters = self.token_ordering.reshape(self.centroids.weight.shape[0], -1)
        ids = clusters[top].reshape(*h.shape[:-1], -1)
        rows = table(ids)  # [..., n, H]
        logits = (rows.astype(h.dtype) @ h[..., None]).squeeze(-1)
        return ids, logits

    def __call__(self, h: mx.array, table: nn.Module) -> mx.array:
        ids, logits = self.selected(h, table)
        floor = logits.min() - 1.0
        out = mx.full((*h.shape[:-1], self.vocab), floor, dtype=logits.dtype)
        return mx.put_along_axis(out, ids, logits, axis=-1)


class AssistantText(nn.Module):
    """The assistant's text model: a tied table, query-only layers, a final norm."""

    def __init__(self, args: Any) -> None:
        super().__init__()
        block = mlx_lm_models("gemma4_text").DecoderLayer
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Gemma4AssistantModel(nn.Module):
    """The assistant in MLX; parameter paths are the checkpoint's tensor names."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        args = assistant_text_args(config)
        backbone = int(config.get("backbone_hidden_size", args.hidden_size))
        self.args = args
        self.sliding_window = int(args.sliding_window)
        self.model = AssistantText(args)
        self.pre_projection = nn.Linear(2 * backbone, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, backbone, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedEmbedding(
                args.hidden_size,
                args.vocab_size,
                int(config.get("num_centroids", 2048)),
                int(config.get("centroid_intermediate_top_k", 32)),
            )

    @property
    def quant_predicate(self) -> Any:
        """What `convert -q` quantizes: every linear and the tied table, except the centroid
        scorer (it picks which tokens get logits at all, and is tiny)."""

        def predicate(path: str, module: nn.Module) -> bool:
            return not path.startswith("masked_embedding.")

        return predicate

    @property
    def ordered(self) -> bool:
        return "masked_embedding" in self

    def masks(self, kv: KV) -> dict[str, mx.array | None]:
        """Per attention type, which K/V entries the query sees: all of them, except that a
        sliding layer sees only the last `window + 1` (transformers' bidirectional sliding
        mask, |q - k| <= window, flipped to look back from the newest entry)."""
        masks: dict[str, mx.array | None] = {}
        for kind, (keys, _) in kv.items():
            length = keys.shape[-2]
            if kind == "sliding_attention" and length > self.sliding_window + 1:
                masks[kind] = mx.arange(length) >= length - self.sliding_window - 1
            else:
                masks[kind] = None
        return masks

    def row_masks(self, kv: KV, starts: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """`masks` for the rows of a batch [B, 1, 1, S]: row r's entries of each type start
        at `starts[kind][r]` (its left padding before them), and a sliding layer sees only
        the last `window + 1` of them."""
        masks: dict[str, mx.array] = {}
        for kind, (keys, _) in kv.items():
            length = keys.shape[-2]
            index = mx.arange(length)[None, :]
            mask = index >= starts[kind][:, None]
            if kind == "sliding_attention":
                mask = mask & (index >= length - self.sliding_window - 1)
            masks[kind] = mask[:, None, None, :]
        return masks

    def hidden_step(
        self, embedded: mx.array, hidden: mx.array, kv: KV, position: int | mx.array,
        masks: Mapping[str, mx.array | None] | None = None,
    ) -> tuple[mx.array, mx.array]:  # fmt: skip
        """(final-normed state, next step's hidden) for `embedded` [B, L, H_b] (the target's
        scaled embedding of the token) and `hidden` [B, L, H_b]; `position` the query's (one
        per row [B] in a batch, with its `row_masks`; default `masks`: one stream's)."""
        x = self.pre_projection(mx.concatenate([embedded, hidden], axis=-1))
        masks = self.masks(kv) if masks is None else masks
        offset = position if isinstance(position, mx.array) else mx.array(position)
        for layer in self.model.layers:
            keys, values = kv[layer.layer_type]
            keys, values = keys.astype(x.dtype), values.astype(x.dtype)
            x, _, _ = layer(
                x, masks[layer.layer_type], None, shared_kv=(keys, values), offset=offset
            )
        h = self.model.norm(x)
        return h, self.post_projection(h)

    def logits(self, h: mx.array) -> mx.array:
        if self.ordered:
            return self.masked_embedding(h, self.model.embed_tokens)
        return self.model.embed_tokens.as_linear(h)

    def greedy(self, h: mx.array) -> mx.array:
        """The argmax token without the full-vocabulary logits where the head is masked."""
        if not self.ordered:
            return mx.argmax(self.logits(h), axis=-1)
        ids, logits = self.masked_embedding.selected(h, self.model.embed_tokens)
        best = mx.argmax(logits, axis=-1, keepdims=True)
        return mx.take_along_axis(ids, best, axis=-1).squeeze(-1)

    def __call__(
        self, embedded: mx.array, hidden: mx.array, kv: KV, position: int
    ) -> tuple[mx.array, mx.array]:
        """One draft step: (logits [B, L, V], next step's hidden [B, L, H_b])."""
        h, next_hidden = self.hidden_step(embedded, hidden, kv, position)
        return self.logits(h), next_hidden


@register
class Gemma4Assistant(Family):
    name = "gemma4_assistant"
    aliases: ClassVar[tuple[str, ...]] = ("gemma4_mtp", "gemma4_unified_assistant")
    standalone = True
    ships_head = False  # no MTP head inside a model: it is a model of its own
    head_class: ClassVar[type[MtpHead]] = NoTrainedHead
    mlx_module = "gemma4_text"
    block_class = "DecoderLayer"
    config_field = "text_config.num_hidden_layers"

    def is_mtp_tensor(self, name: str) -> bool:
        return True

    def head_relative(self, name: str) -> str | None:
        return name

    def mtp_layer_prefix(self, name: str) -> str | None:
        return None

    def rename_backbone(self, name: str) -> str | None:
        # The tied output head is the table itself (transformers `_tied_weights_keys`).
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", True))

    def split_tensor(self, name: str) -> list[tuple[str, Any]] | None:
        # Published as int64; MLX indexes with int32, and the vocabulary fits it.
        if name == TOKEN_ORDERING:
            return [(name, lambda a: a.astype(mx.int32))]
        return None

    @property
    def text(self) -> dict[str, Any]:
        text = self.config.get("text_config")
        return text if isinstance(text, dict) else {}

    def build_model(self) -> Gemma4AssistantModel:
        return Gemma4AssistantModel(self.config)

    def pairing(self) -> dict[str, Any]:
        """The facts a target must match (`inspect`'s `pairing`)."""
        text = self.text
        types = sorted(set(layer_types(text)))
        return {
            "role": "assistant",
            "backbone_hidden_size": self.config.get("backbone_hidden_size"),
            "hidden_size": text.get("hidden_size"),
            "vocab_size": text.get("vocab_size"),
            "layers": text.get("num_hidden_layers"),
            "layer_types": types,
            "head_dim": {t: head_dims(text)[t] for t in types},
            "attention_heads": text.get("num_attention_heads"),
            "sliding_window": text.get("sliding_window"),
            "ordered_embeddings": bool(self.config.get("use_ordered_embeddings")),
            "output_head": "centroid-masked"
            if self.config.get("use_ordered_embeddings")
            else "dense",
            "num_centroids": self.config.get("num_centroids"),
            "centroid_top_k": self.config.get("centroid_intermediate_top_k"),
        }

    def checkpoint_problems(self, shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
        """(code, message) for what keeps this checkpoint from drafting."""
        problems: list[tuple[str, str]] = []
        text = self.text
        layers = int(text.get("num_hidden_layers") or 0)
        missing = [n for n in REQUIRED if n not in shapes]
        missing += [
            f"model.layers.{i}.{rel}"
            for i in range(layers)
            for rel in LAYER_REQUIRED
            if f"model.layers.{i}.{rel}" not in shapes
        ]
        if "model.embed_tokens.weight" not in shapes and "lm_head.weight" not in shapes:
            missing.append("model.embed_tokens.weight")
        if missing:
            problems.append(
                (
                    "incomplete_mtp",
                    f"the assistant lacks {len(missing)} required tensors (first: {missing[0]})",
                )
            )
        if self.config.get("use_ordered_embeddings"):
            if TOKEN_ORDERING not in shapes:
                problems.append(
                    (
                        "missing_token_ordering",
                        f"use_ordered_embeddings is set but {TOKEN_ORDERING} is absent: the "
                        "centroid-masked head cannot map clusters to tokens; download the "
                        "assistant again (the buffer is part of the published checkpoint)",
                    )
                )
            vocab, centroids = (
                int(text.get("vocab_size", 0)),
                int(self.config.get("num_centroids") or 0),
            )
            if centroids and vocab % centroids:
                problems.append(
                    (
                        "invalid_config",
                        f"vocab_size {vocab} is not a multiple of num_centroids {centroids}",
                    )
                )
        problems += self._hidden_size_problems(shapes)
        shared = text.get("num_kv_shared_layers")
        if shared and int(shared) != layers:
            problems.append(
                (
                    "invalid_config",
                    f"text_config.num_kv_shared_layers is {shared} but an assistant's "
                    f"{layers} layers must all read the target's K/V",
                )
            )
        return problems

    def _hidden_size_problems(self, shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
        backbone = self.config.get("backbone_hidden_size")
        pre, post = shapes.get("pre_projection.weight"), shapes.get("post_projection.weight")
        if not isinstance(backbone, int) or backbone <= 0:
            return [
                (
                    "invalid_config",
                    "config.json has no backbone_hidden_size (the target's hidden size): "
                    "take the assistant's config from its published repo",
                )
            ]
        widths = []
        if pre is not None and len(pre) == 2:
            widths.append(("pre_projection.weight", pre[1], 2 * backbone))
        if post is not None and len(post) == 2:
            widths.append(("post_projection.weight", post[0], backbone))
        return [
            (
                "assistant_unpairable",
                f"{name} is sized for a target of hidden size {got // (2 if 'pre' in name else 1)}"
                f" but backbone_hidden_size is {backbone}: no target fits both",
            )
            for name, got, want in widths
            if got != want
        ]


def pairing_problems(assistant: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    """Why an assistant's `pairing` facts do not fit a target's (empty: they pair)."""
    wants = target["assistant"]
    problems = []
    if assistant.get("backbone_hidden_size") != wants["backbone_hidden_size"]:
        problems.append(
            f"the assistant drafts for hidden size {assistant.get('backbone_hidden_size')}, "
            f"the target's is {wants['backbone_hidden_size']}"
        )
    if assistant.get("vocab_size") != wants["vocab_size"]:
        problems.append(
            f"vocabularies differ ({assistant.get('vocab_size')} vs {wants['vocab_size']})"
        )
    for kind in assistant.get("layer_types") or []:
        if kind not in wants["layer_types"]:
            problems.append(f"the target has no {kind} layer to read K/V from")
        elif assistant["head_dim"][kind] != wants["head_dim"][kind]:
            problems.append(
                f"{kind} head size {assistant['head_dim'][kind]} differs from the target's "
                f"{wants['head_dim'][kind]}"
            )
    heads = assistant.get("attention_heads") or 0
    if heads % wants["attention_heads_multiple_of"]:
        problems.append(
            f"{heads} query heads do not group over the target's "
            f"{wants['attention_heads_multiple_of']} K/V heads"
        )
    return problems


__all__ = [
    "Gemma4Assistant",
    "Gemma4AssistantModel",
    "MaskedEmbedding",
    "assistant_text_args",
    "pairing_problems",
]
