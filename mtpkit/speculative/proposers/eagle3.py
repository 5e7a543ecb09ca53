"""An EAGLE-3 drafter as the proposer (`--draft-model EAGLE3_DIR`).

The target's passes yield, at every position p, the inputs of the three layers the drafter
reads (`mtpkit.runtime.eagle3.tap_layer_inputs`); with the token that followed, that is a
confirmed pair (g_p, t_{p+1}). The drafter runs over the pairs it has not seen (into its
own KV cache, as EAGLE's `stable_kv`), drafts the first token from the last, and chains the
rest on its own outputs, one step each (`cnets.Model.topK_genrate` with one branch). The
chained steps' K/V are taken back after the verdict (`PassUndo`: a trim of its KV cache),
and the round's confirmed pairs, from the verify pass's own taps, wait for the next round.

When sampling, each draft is drawn from the drafter's distribution over its draft
vocabulary, mapped to target ids through `d2t` (zero elsewhere), so that rejection sampling
divides by the distribution the draft came from (`mtpkit.runtime.draft_vocab.SubsetVocab`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.runtime.draft_vocab import FullVocab, SubsetVocab
from mtpkit.runtime.eagle3 import Eagle3Drafter, tap_layer_inputs
from mtpkit.runtime.kernels.attention import few_query_attention
from mtpkit.runtime.model import MtpModel
from mtpkit.runtime.rollback.discard import PassUndo
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import DrafterKind, Proposal, ProposerBase

CATCH_UP_CHUNK = 256  # pending pairs past which they go into the drafter's cache at once


class Eagle3Proposer(ProposerBase):
    """Drafts with `drafter` for the target `m` (see the module's text). `step_cost`: a
    draft step's share of a target step, for adaptive drafting."""

    name = "eagle3"
    batches = True

    def __init__(self, m: MtpModel, drafter: Eagle3Drafter, step_cost: float | None = None) -> None:
        self.m, self.drafter = m, drafter
        tap_layer_inputs(m, drafter.layout.layer_ids(len(m.parts.layers)))
        model = drafter.model
        self.cache = model.make_cache()
        self.features: list[mx.array] = []  # pending pairs' target states [1, T, 3H_t]
        self.tokens: list[int] = []  # and the token after each
        self.blind = False  # a restored state older than the target's cache: no drafts
        self.step_cost = step_cost
        self._undo: PassUndo | None = None
        if drafter.target_ids is None:
            self.vocab = FullVocab(model.draft_logits)
        else:
            self.vocab = SubsetVocab(
                drafter.target_ids, model.draft_logits, model.layout.vocab_size
            )

    @property
    def covered(self) -> int:
        """Confirmed pairs it holds (in its cache or pending): positions 0 .. covered-1."""
        return int(self.cache[0].offset) + len(self.tokens)

    def caches(self) -> list[Any]:
        return list(self.cache)

    def _embed(self, tokens: mx.array) -> mx.array:
        own = getattr(self.drafter.model, "embed_tokens", None)
        return own(tokens) if own is not None else self.m.embed(tokens)

    def begin(self, prompt: list[int], cached: int) -> None:
        if self.covered < cached:
            self.blind = True
            return
        self.blind = False
        keep = cached - int(self.cache[0].offset)
        if keep < 0:
            self.cache[0].trim(-keep)
            self.features, self.tokens = [], []
        elif keep < len(self.tokens):
            self.features = [mx.concatenate(self.features, axis=1)[:, :keep]] if keep else []
            self.tokens = self.tokens[:keep]

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        self.features.append(hidden)
        self.tokens.extend(tokens)
        if len(self.tokens) > CATCH_UP_CHUNK:
            self._run_pending(keep_last=True)  # a prompt's chunk, or plain steps
            mx.eval([c.state for c in self.cache])

    def _run_pending(self, keep_last: bool = False) -> mx.array:
        """The drafter over the pending pairs (into its cache); its output at the last."""
        features = mx.concatenate(self.features, axis=1)
        n = len(self.tokens) - (1 if keep_last else 0)
        model = self.drafter.model
        embeds = self._embed(mx.array(self.tokens[:n], dtype=mx.int32)[None])
        with few_query_attention():  # CUDA: no cuDNN build at each new key length
            out = model(embeds, model.fuse(features[:, :n]), self.cache)
        self.features = [features[:, n:]] if keep_last else []
        self.tokens = self.tokens[n:]
        return out[:, -1:]

    def can_propose(self) -> bool:
        return not self.blind and bool(self.tokens)

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal:
        model, vocab = self.drafter.model, self.vocab
        x = self._run_pending()
        self._undo = PassUndo.before(self.caches(), depth - 1)  # the chained steps' K/V
        drafts: list[mx.array] = []
        dists = []
        for k in range(depth):
            if k > 0:
                x = model(self._embed(drafts[-1].reshape(1, 1)), x, self.cache)
            logits = vocab.logits(x)[0, -1]
            token, dist = vocab.draw(sampling, logits)
            if dist is not None:
                dists.append(dist)
            drafts.append(token.reshape(1))
        return Proposal(mx.concatenate(drafts), mx.stack(dists) if dists else None)

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> mx.array:
        return hidden  # the verify inputs' target states [1, K+1, 3H_t]

    def settle(self, state: mx.array, verdict: Verdict, premise_held: bool) -> None:
        """The chained steps leave the cache; the round's confirmed pairs wait."""
        if self._undo is not None:
            self._undo.undo(self.caches())
            self._undo = None
        kept = verdict.accepted + 1
        self.features.append(state[:, :kept])
        self.tokens.extend(verdict.confirmed)

    def batched(self) -> Any:
        from mtpkit.speculative.proposers.eagle3_rows import Eagle3Rows

        return Eagle3Rows(self)

    def cost_prior(self, depth: int) -> float | None:
        """The head's prior at `depth` plus `depth` drafter steps, each the share of a
        target step its weights' bytes make (set by the factory)."""
        if self.step_cost is None:
            return None
        from mtpkit.speculative.adaptive import prior_cost
        from mtpkit.speculative.proposers.draft_model import MIN_STEP_COST

        return prior_cost(depth) + depth * max(self.step_cost, MIN_STEP_COST)


def _load(m: MtpModel, spec: Any, where: Any) -> Any:
    from mtpkit.runtime.eagle3 import check_target, load_eagle3
    from mtpkit.speculative.proposers.target import embedding_rows, share_of

    drafter = load_eagle3(where)
    check_target(drafter, m.config, embedding_rows(m), (str(spec), m.path.name))
    share = share_of(m, drafter.parameter_bytes)
    return lambda: Eagle3Proposer(m, drafter, share)


def _find(spec: Any) -> Any:
    from mtpkit.runtime.eagle3 import eagle3_directory

    return eagle3_directory(spec)


KIND = DrafterKind("eagle3", _find, _load)
