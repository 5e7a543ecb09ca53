"""A separate, smaller model of the same tokenizer as the proposer (`--draft-model`).

Each round it runs over the confirmed tokens it has not seen (one forward), then chains K-1
single-token steps over its own drafts, each launched as it is built (as mlx-lm's
`speculative_generate_step` does: the draft model computes while the host builds the next
step and the target's verify pass). After the verdict its caches keep what was confirmed:

- KV caches only (an attention-only draft model): the drafts it fed that the target kept
  stay, the others are trimmed, as mlx-lm trims; the next round feeds only the target's
  token (and the last draft, when every draft was kept);
- any other cache (a hybrid draft model, Qwen3.5-0.8B for Qwen3.5-27B: recurrent or sliding-
  window states that a trim cannot take back): the caches go back to the state after the
  confirmed tokens (`PassUndo`), and the kept drafts are fed with the next round's token,
  exact for every cache kind. mlx-lm's own `speculative_generate_step` refuses such caches
  (mlx-lm #1446).

A pair is compatible when the tokenizers agree (vocabulary size, the ids of a probe text,
the special tokens), as LM Studio's mlx-engine checks; logits past the target's vocabulary
(a padded embedding) are never drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import MtpModel, load_backbone, resolve_model_path
from mtpkit.runtime.rollback.discard import PassUndo, trim_undoes
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.adaptive import prior_cost
from mtpkit.speculative.proposers.base import DrafterKind, Proposal, ProposerBase

FEED_CHUNK = 2048  # tokens per draft-model forward when it catches up
PROBE_TEXT = "def main():\n    print('Hello, world!')  # 12 ÷ 3 = 4; über café 東京\n"
MIN_STEP_COST = 0.05  # a draft step never counts as free against a target step


class IncompatibleDraftModel(MtpkitError):
    """A draft model whose tokenizer differs from the target's."""


@dataclass
class DraftModel:
    """A draft model loaded with stock mlx-lm: its path, model, tokenizer, config."""

    path: Path
    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]

    @property
    def parameter_bytes(self) -> int:
        from mtpkit.runtime.headload import parameter_bytes

        return parameter_bytes(self.model)


def load_draft_model(spec: str | Path, revision: str | None = None) -> DraftModel:
    """A local MLX directory or a Hub repo, as `mlx_lm.load` reads it."""
    path = resolve_model_path(str(spec), revision)
    model, tokenizer, config = load_backbone(path)
    return DraftModel(path, model, tokenizer, config)


def _special_ids(tokenizer: Any) -> dict[str, Any]:
    """The tokenizer's own special tokens (not the EOS set a command line may extend)."""
    return {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "bos", "pad")}


def incompatibility(target: Any, draft: Any) -> str | None:
    """The first difference between two tokenizers that makes drafting with one for the
    other wrong (None: compatible)."""
    sizes = (getattr(target, "vocab_size", None), getattr(draft, "vocab_size", None))
    if sizes[0] != sizes[1]:
        return f"a vocabulary of {sizes[1]} tokens against the target's {sizes[0]}"
    ids = (target.encode(PROBE_TEXT), draft.encode(PROBE_TEXT))
    if ids[0] != ids[1]:
        at = next(
            (i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b), min(map(len, ids))
        )
        return f"other token ids for the same text (from token {at} of a probe text)"
    specials = (_special_ids(target), _special_ids(draft))
    for name in ("eos", "bos", "pad"):
        if specials[0][name] != specials[1][name]:
            return f"{name} token {specials[1][name]} against the target's {specials[0][name]}"
    return None


def check_compatible(m: MtpModel, draft: DraftModel) -> None:
    """Refuse a draft model whose tokenizer is not the target's, before any decoding."""
    problem = incompatibility(m.tokenizer, draft.tokenizer)
    if problem is not None:
        raise IncompatibleDraftModel(
            f"--draft-model {draft.path.name} cannot draft for {m.path.name}: it has "
            f"{problem}; a draft model must share the model's tokenizer (take one of the same family)"
        )


def _load(m: MtpModel, spec: str | Path, where: Any) -> Any:
    """Any other model directory or Hub repo: a draft model of the target's tokenizer."""
    from mtpkit.speculative.proposers.target import logits_width, share_of

    draft = load_draft_model(spec)
    check_compatible(m, draft)
    vocab, step_cost = logits_width(m), share_of(m, draft.parameter_bytes)
    return lambda: DraftModelProposer(draft, vocab, step_cost)


# The last kind `choose.DIRECTORY_DRAFTERS` tries: it takes any model.
KIND = DrafterKind("draft-model", lambda spec: spec, _load)


class DraftModelProposer(ProposerBase):
    """Drafts with `draft` (see the module's text). `vocab`: the width of the target's
    logits, the ids a draft may take."""

    name = "draft-model"

    def __init__(self, draft: DraftModel, vocab: int, step_cost: float | None = None) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.draft, self.vocab = draft, vocab
        self.cache = make_prompt_cache(draft.model)
        self.history: list[int] = []  # prompt and confirmed tokens
        self.fed = 0  # of them, those in the draft model's cache
        self.step_cost = step_cost
        self.prefilling = False
        # Whether a trim takes back any of its caches' steps (else `PassUndo` does).
        self.trims = all(trim_undoes(c) for c in self.cache)
        self._undo: PassUndo | None = None  # takes the last chain of drafts back
        self._fed_drafts: mx.array | None = None  # the drafts the last chain fed [K-1]

    def caches(self) -> list[Any]:
        return list(self.cache)

    def begin(self, prompt: list[int], cached: int) -> None:
        self.history = list(prompt)
        self.fed = min(self.fed, cached)  # a restored state saw `cached` tokens at most
        self.prefilling = True  # the prompt's tokens are in `history` already

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        if not self.prefilling:
            self.history.extend(tokens)  # a plain step's token

    def end_prefill(self) -> None:
        self.prefilling = False
        self._feed(self.history[self.fed : -1])  # all but the last: it starts the first round
        mx.eval([c.state for c in self.cache])

    def _feed(self, tokens: list[int]) -> mx.array | None:
        """Run the draft model over `tokens`; the logits after the last (lazy), if any."""
        logits = None
        for i in range(0, len(tokens), FEED_CHUNK):
            chunk = tokens[i : i + FEED_CHUNK]
            logits = self.draft.model(mx.array(chunk)[None], cache=self.cache)[:, -1]
            self.fed += len(chunk)
            if i + FEED_CHUNK < len(tokens):
                mx.eval(logits, [c.state for c in self.cache])
        return logits

    def _draw(
        self, logits: mx.array, sampling: SamplingSettings
    ) -> tuple[mx.array, mx.array | None]:
        """A draft from the draft model's logits [1, V_d], over the target's ids only."""
        width = logits.shape[-1]
        if width > self.vocab:
            logits = logits[..., : self.vocab]
        elif width < self.vocab:
            pad = mx.full((*logits.shape[:-1], self.vocab - width), -mx.inf, logits.dtype)
            logits = mx.concatenate([logits, pad], axis=-1)
        logits = logits[0]
        if sampling.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32).reshape(1), None
        q = sampling.probs(logits)
        return mx.random.categorical(mx.log(q)).astype(mx.int32).reshape(1), q

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal:
        logits = self._feed(self.history[self.fed :])
        drafts, dists = [], []
        self._undo = None if self.trims else PassUndo.before(self.caches(), depth - 1)
        for k in range(depth):
            if k > 0:
                logits = self.draft.model(drafts[-1][None], cache=self.cache)[:, -1]
            token, q = self._draw(logits, sampling)
            mx.async_eval(token)  # computed while the next step is built
            drafts.append(token)
            if q is not None:
                dists.append(q)
        self._fed_drafts = mx.concatenate(drafts[:-1]) if depth > 1 else None
        return Proposal(mx.concatenate(drafts), mx.stack(dists) if dists else None)

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> tuple[mx.array | None, PassUndo | None]:
        return self._fed_drafts, self._undo

    def settle(self, state: tuple[mx.array | None, PassUndo | None], verdict: Verdict,
               premise_held: bool) -> None:  # fmt: skip
        """Keep the fed drafts the target kept (a trim drops the others), or go back to the
        state after the confirmed tokens (`PassUndo`); the rest of the confirmed tokens are
        fed with the next round's first forward. A fed draft counts as kept only if it is
        the token confirmed there (a draft filter may have verified others: bench's oracle,
        tests), so the cache always holds the confirmed text."""
        fed_drafts, undo = state
        if undo is not None:
            undo.undo(self.caches())
        elif fed_drafts is not None:
            fed = fed_drafts.tolist()  # computed before the verdict: no wait
            kept = 0
            while kept < min(verdict.accepted, len(fed)) and fed[kept] == verdict.drafts[kept]:
                kept += 1
            if len(fed) > kept:
                for cache in self.cache:
                    cache.trim(len(fed) - kept)
            self.fed += kept
        self.history.extend(verdict.confirmed)

    def cost_prior(self, depth: int) -> float | None:
        """The head's prior at `depth` plus `depth` steps of the draft model, each the
        share of a target step its weights' bytes make (set by the factory)."""
        if self.step_cost is None:
            return None
        return prior_cost(depth) + depth * max(self.step_cost, MIN_STEP_COST)

    # A batch's side lives in `draft_model_rows` (its own caches per row).
    @property
    def batches(self) -> bool:  # type: ignore[override]
        from mtpkit.speculative.proposers.draft_model_rows import batches

        return batches(self)

    def batched(self) -> Any:
        from mtpkit.speculative.proposers.draft_model_rows import DraftRows

        return DraftRows(self) if self.batches else None
