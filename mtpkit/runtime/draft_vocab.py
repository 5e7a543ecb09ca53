"""The vocabulary the MTP head drafts over: all of it, or the subset `mtpkit convert
--draft-vocab N` chose (`mtp/draft_vocab.safetensors`, `mtpkit.convert.draft_vocab`).

A subset's logits are the lm_head's rows for its ids only (the same weights, sliced once at
load: plain, quantized or tied to the embedding), so a draft step's widest matrix costs N/V
of the full one. A draft is an index into the subset, mapped back to its token id. When
sampling, the draft is drawn from the subset's distribution q, and the decoder gets q spread
over the whole vocabulary (zero outside the subset): rejection sampling divides by the very
distribution the draft came from, so the output keeps the model's distribution. The verify
pass always scores the whole vocabulary: greedy output is the model's own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError

if TYPE_CHECKING:
    from mtpkit.speculative.accept import SamplingSettings

DRAFT_VOCAB_PATH = "mtp/draft_vocab.safetensors"


class FullVocab:
    """Drafting over every token: the model's own lm_head."""

    size: int | None = None  # every token

    def __init__(self, lm_head: Any) -> None:
        self.lm_head = lm_head

    def logits(self, x: mx.array) -> mx.array:
        return self.lm_head(x)

    def token(self, index: mx.array) -> mx.array:
        return index

    def spread(self, q: mx.array) -> mx.array:
        return q

    def probs(self, sampling: SamplingSettings, logits: mx.array) -> mx.array:
        return sampling.probs(logits)

    def draw(
        self, sampling: SamplingSettings, logits: mx.array, key: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """One draft (int32 token id) from one position's `logits`: the argmax when greedy,
        else a draw (by `key`) from the settings' distribution, which comes back too, spread
        over the whole vocabulary (rejection sampling divides by it); None when greedy."""
        if sampling.greedy:
            return self.token(mx.argmax(logits, axis=-1)).astype(mx.int32), None
        q = self.probs(sampling, logits)
        token = self.token(mx.random.categorical(mx.log(q), key=key)).astype(mx.int32)
        return token, self.spread(q)


class SubsetVocab(FullVocab):
    """Drafting over `ids` [N] (sorted token ids) of a `vocab`-wide lm_head."""

    def __init__(self, ids: mx.array, lm_head: Any, vocab: int) -> None:
        super().__init__(lm_head)
        self.ids = ids
        self.size = int(ids.shape[0])
        self.vocab = vocab

    def token(self, index: mx.array) -> mx.array:
        return self.ids[index]

    def spread(self, q: mx.array) -> mx.array:
        """[..., N] -> [..., V]: the subset's distribution with zeros elsewhere."""
        full = mx.zeros((*q.shape[:-1], self.vocab), dtype=q.dtype)
        full[..., self.ids] = q
        return full

    def probs(self, sampling: SamplingSettings, logits: mx.array) -> mx.array:
        if sampling.top_k >= self.size:  # keeps the whole subset: no cut to make
            sampling = dataclasses.replace(sampling, top_k=0)
        return sampling.probs(logits)


def sliced_rows(module: nn.Module, ids: mx.array, *, tied: bool) -> Any:
    """A callable x [..., H] -> [..., N]: `module`'s output rows `ids` (an lm_head, or with
    `tied` the embedding used as one), computed as the module computes them."""
    weight = module["weight"][ids]
    mx.eval(weight)
    if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
        scales = module["scales"][ids]
        biases = module.get("biases")
        biases = biases[ids] if biases is not None else None
        bias = None if tied else module.get("bias")
        bias = bias[ids] if bias is not None else None
        mx.eval(scales, biases, bias)
        group_size, bits, mode = module.group_size, module.bits, getattr(module, "mode", "affine")

        def quantized(x: mx.array) -> mx.array:
            y = mx.quantized_matmul(
                x, weight, scales=scales, biases=biases, transpose=True,
                group_size=group_size, bits=bits, mode=mode,
            )  # fmt: skip
            return y + bias if bias is not None else y

        return quantized
    if isinstance(module, nn.Linear | nn.Embedding):
        bias = None if tied else module.get("bias")
        bias = bias[ids] if bias is not None else None

        def plain(x: mx.array) -> mx.array:
            y = x @ weight.T
            return y + bias if bias is not None else y

        return plain
    raise MtpkitError(
        f"--draft-vocab needs a linear lm_head; this model's is {type(module).__name__}: "
        "convert without --draft-vocab"
    )


def load_draft_vocab(
    path: Path, manifest: dict[str, Any] | None, tokenizer: Any, parts: Any, vocab: int
) -> SubsetVocab | None:
    """The subset recorded in `path`'s head manifest, checked against the model's tokenizer
    and vocabulary; None when the head drafts over every token."""
    record = (manifest or {}).get("draft_vocab")
    if not record:
        return None
    from mtpkit.convert.draft_vocab import tokenizer_sha256

    where = path / DRAFT_VOCAB_PATH
    if not where.is_file():
        raise MtpkitError(
            f"{path}'s manifest records a draft vocabulary but {DRAFT_VOCAB_PATH} is missing: "
            "convert again"
        )
    if record.get("tokenizer_sha256") != tokenizer_sha256(tokenizer):
        raise MtpkitError(
            f"{DRAFT_VOCAB_PATH} in {path} was made for another tokenizer (its vocabulary hash "
            "differs): convert again with --draft-vocab"
        )
    ids = mx.load(str(where)).get("ids")
    if ids is None or ids.ndim != 1 or ids.shape[0] < 1:
        raise MtpkitError(f"{DRAFT_VOCAB_PATH} in {path} holds no 1-D `ids`: convert again")
    ids = ids.astype(mx.int32)
    values = ids.tolist()
    if min(values) < 0 or max(values) >= vocab or values != sorted(set(values)):
        raise MtpkitError(
            f"{DRAFT_VOCAB_PATH} in {path} holds ids outside 0..{vocab - 1} or repeated ones: "
            "convert again"
        )
    tied = parts.lm_head is None
    rows = sliced_rows(parts.embedding if tied else parts.lm_head, ids, tied=tied)
    return SubsetVocab(ids, rows, vocab)
