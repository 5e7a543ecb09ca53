"""What every drafter gives the decoder, and what the decoder tells it: the proposer seam.

A round: the proposer proposes K tokens (`propose`), the target verifies `[last, drafts]` in
one pass, the verdict keeps a prefix (`mtpkit.speculative.accept`), and the proposer is told
the outcome (`settle`). Between rounds it sees the confirmed tokens of plain steps and of the
prefill (`observe`). A proposer owns its state (a KV cache, pending pairs, a token history);
the decoder owns the target's cache and hands the proposer what it asks of a round.

Pipelined rounds (`looks_ahead`): a proposer that can draft from lazy values proposes the
next round before this round's verdict is read, on the premise that every draft is kept
(`assume_kept`); if the premise fails, the queued round is taken back (`discard`) before this
round is settled. A proposer that needs host values (a token history) says `looks_ahead`
False, and the decoder then always reads the verdict first.

Sampling stays exact only if `Proposal.dists` holds the distributions the drafts were drawn
from (rejection sampling divides by them); a deterministic proposer gives one-hot rows.
Like vLLM's proposers (`spec_decode/`: eagle, medusa, ngram), one file per drafter.

The rows of a batch (`RowsProposer`): the same seam over B rows, one stream being a row. A
request is prefilled alone by its own `Proposer`, exactly as one stream is, then joins the
batch's drafter (`Proposer.batched` makes it from the first row, `RowsProposer.join` takes
each next one; `RowsProposer.attach` hands it the batch's target caches), which owns every
row's state from then on: a round's drafts per row (and their distributions when sampling,
each row with its own settings and keys), the verify pass's pairs (`after_verify`), each
row's kept count (`settle`, or `settle_on_device` for a round built before the one before
it is read), the pairs of plain batched steps (`observe`), rows leaving (`keep`), and a row
taken out as one stream's proposer again (`take`: a prompt cache's entry). A drafter that
returns None from `batched` decodes alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

if TYPE_CHECKING:
    from mtpkit.runtime.draft_vocab import FullVocab
    from mtpkit.runtime.model import MtpModel
    from mtpkit.speculative.accept import SamplingSettings, Verdict


@dataclass
class Proposal:
    """A round's drafts: `drafts` [K] int32 (lazy), and when sampling `dists` [K, V]: the
    distribution each draft was drawn from."""

    drafts: mx.array
    dists: mx.array | None = None

    @property
    def depth(self) -> int:
        return self.drafts.shape[0]


class Proposer(Protocol):
    """A drafter behind the decoder (see the module's text)."""

    name: str  # how outputs and `--json` name it: "mtp", "draft-model", "prompt-lookup", ...
    looks_ahead: bool  # can propose from a round whose verdict is unread (lazy followers)
    drafts_locally: bool  # False: placeholders that rank 0's shared drafts replace
    batches: bool  # `batched` gives a batch's drafter (False: its requests decode alone)

    def caches(self) -> list[Any]:
        """The caches it owns and changes while proposing: a look-ahead round built but not
        launched is taken back by restoring them."""
        ...

    def attach(self, cache: list[Any]) -> None:
        """The target's cache of this sequence, as the decoder rolls it back after each
        verdict (a drafter that reads it: Gemma 4's assistant)."""
        ...

    def begin(self, prompt: list[int], cached: int) -> None:
        """A new sequence: `prompt`, whose first `cached` tokens this proposer has already
        seen (a session's prompt cache restored its state with the target's)."""
        ...

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        """Confirmed pairs the target computed outside a round (prefill chunks, plain
        steps): its hidden states [1, T, H] and the token that followed each."""
        ...

    def end_prefill(self) -> None:
        """The prompt is in the target's cache: catch up with it (a draft model's prefill,
        the head's pass over the prompt's pairs)."""
        ...

    def defers_catch_up(self) -> bool:
        """Whether `end_prefill` (called next) is worth running after the first token, which
        the target then takes alone (its logits at the last prompt token) and which goes
        out before the catch-up: the time to first token is then the target's prefill."""
        ...

    def can_propose(self) -> bool:
        """Whether a round could start now (a proposer may still find nothing to propose)."""
        ...

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal | None:
        """Up to `depth` drafts after the last confirmed token (None: nothing worth
        verifying; the decoder takes a plain step)."""
        ...

    def after_verify(self, proposal: Proposal, hidden: mx.array, followers: mx.array,
                     launch: bool) -> Any:  # fmt: skip
        """The target verified the round (hidden [1, K+1, H]; `followers` [K+1]: the
        confirmed token after each verify input, lazy, valid up to the count kept). Queue
        any work over those pairs before the verdict is read; returns the round's state
        that `settle`, `assume_kept` and `discard` get back."""
        ...

    def assume_kept(self, state: Any) -> None:
        """Premise of a look-ahead round: every draft of the round of `state` is kept."""
        ...

    def discard(self, state: Any, launched: bool) -> None:
        """Take back a look-ahead round's own effects (a launched one's; an unlaunched
        one's caches the decoder restores)."""
        ...

    def settle(self, state: Any, verdict: Verdict, premise_held: bool) -> None:
        """The round's verdict: `verdict.accepted` drafts kept, then `verdict.token`.
        `premise_held`: a look-ahead round built on `assume_kept` stays queued."""
        ...

    def judged(self, verdict: Verdict) -> Verdict:
        """The verdict as this proposer's contract makes it: itself for every drafter
        (bench's oracle holds a random-weight model to its plan)."""
        ...

    def rest(self, parked: bool) -> None:
        """Whether adaptive drafting has parked this proposer, or paused one that never had
        a draft kept (`AdaptiveDrafting.resting`): while it is, what it keeps only to draft
        well at the next retry may go."""
        ...

    def cost_prior(self, depth: int) -> float | None:
        """A round's cost at `depth` in plain target steps, for adaptive drafting (None:
        the backend's prior for the MTP head)."""
        ...

    def fork(self) -> Proposer:
        """A proposer in this one's state that changes on its own from now on (a session's
        prompt cache keeps one per cached prefix)."""
        ...

    def batched(self) -> RowsProposer | None:
        """A batch's drafter whose only row is this proposer's sequence (prefilled, its
        first token observed); None: this drafter decodes alone."""
        ...


class ProposerBase:
    """Defaults for the optional parts of `Proposer`."""

    name = "proposer"
    looks_ahead = False
    drafts_locally = True
    batches = False

    def caches(self) -> list[Any]:
        return []

    def attach(self, cache: list[Any]) -> None:
        return None

    def begin(self, prompt: list[int], cached: int) -> None:
        return None

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        return None

    def end_prefill(self) -> None:
        return None

    def defers_catch_up(self) -> bool:
        return False

    def can_propose(self) -> bool:
        return True

    def after_verify(self, proposal: Proposal, hidden: mx.array, followers: mx.array,
                     launch: bool) -> Any:  # fmt: skip
        return proposal

    def assume_kept(self, state: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not look ahead")

    def discard(self, state: Any, launched: bool) -> None:
        return None

    def judged(self, verdict: Verdict) -> Verdict:
        return verdict

    def rest(self, parked: bool) -> None:
        return None

    def cost_prior(self, depth: int) -> float | None:
        return None

    def fork(self) -> Proposer:
        """A shallow copy whose lists are its own and whose caches are forked
        (`mtpkit.runtime.rollback.state.fork_cache`); arrays are values and are shared."""
        import copy

        from mtpkit.runtime.rollback.state import fork_cache, is_cache

        forked = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, list):
                setattr(forked, name, [fork_cache(v) if is_cache(v) else v for v in value])
        return forked

    def batched(self) -> RowsProposer | None:
        return None


@dataclass
class RowsProposal:
    """A batched round's drafts: `drafts` [B, K] int32 (lazy; K the deepest row's), row r
    verifying its first `depths[r]` (0: a plain step inside the round), and for each sampled
    row the distributions [K, V] its drafts were drawn from (None for a greedy row)."""

    drafts: mx.array
    depths: list[int]
    dists: list[mx.array | None]

    @property
    def depth(self) -> int:
        return self.drafts.shape[1]

    @classmethod
    def plain(cls, depths: list[int]) -> RowsProposal:
        """No drafts for any row (every row's drafting is off): a plain step for all."""
        return cls(mx.zeros((len(depths), 0), dtype=mx.int32), depths, [None] * len(depths))


class RowsProposer(Protocol):
    """A drafter for the rows of a batch (see the module's text); row r is the batch's r-th
    row, in the order rows joined, less those that left."""

    name: str
    # Settles from kept counts on the device: a round may be built before the one before
    # it is read (False: the decoder reads every round first, as `looks_ahead` for one).
    rolls_on_device: bool

    def attach(self, cache: list[Any]) -> None:
        """The batch's target caches, as the decoder rolls each row back after its verdict
        (a drafter that reads them: Gemma 4's assistant); rows join and leave them in place."""
        ...

    def join(self, proposer: Proposer) -> None:
        """One more row, last: `proposer`'s sequence (prefilled, its first token observed)."""
        ...

    def keep(self, index: list[int]) -> None:
        """Rows leave: keep rows `index`, in that order."""
        ...

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        """A plain batched step's pairs: each row's hidden state [B, 1, H] and the token
        that followed it [B, 1] (computed)."""
        ...

    def propose(
        self, depths: list[int], sampling: list[SamplingSettings],
        keys: list[list[mx.array | None]],
    ) -> RowsProposal:  # fmt: skip
        """Up to `depths[r]` drafts for row r (keys[r][k]: the PRNG key of its k-th draw,
        None: MLX's global state)."""
        ...

    def after_verify(self, proposal: RowsProposal, hidden: mx.array, followers: mx.array) -> Any:
        """The target verified the round (hidden [B, K+1, H]; `followers` [B, K+1]: the
        confirmed token after each verify input, lazy, valid up to each row's count kept).
        Returns the round's state that `settle` gets back."""
        ...

    def settle(self, state: Any, kept: list[int], confirmed: list[list[int]]) -> None:
        """Row r kept its first `kept[r]` verify inputs (its accepted drafts and the token
        before them); `confirmed[r]`: the tokens the round confirmed for it (as many)."""
        ...

    def settle_on_device(self, state: Any, kept: mx.array) -> list[mx.array]:
        """`settle` with the counts on the device ([B] int32, not read yet); returns the
        lazy state it set, for the decoder to launch with the round."""
        ...

    def take(self, r: int, tokens: list[int]) -> Proposer:
        """Row r as one stream's proposer (a prompt cache's entry); `tokens`: its prompt and
        the tokens confirmed for it."""
        ...

    def take_ended(self, r: int, state: Any, index: int, taken: int, extra: int) -> Proposer:
        """Row r as `take` gives it, from a round settled on the device (`state`, in which
        it was row `index`) that confirmed `extra` tokens past the `taken` it keeps."""
        ...


class RowsBase:
    """Defaults for the optional parts of `RowsProposer`."""

    name = "proposer"
    rolls_on_device = False

    def attach(self, cache: list[Any]) -> None:
        return None

    def observe(self, hidden: mx.array, tokens: mx.array) -> None:
        return None

    def after_verify(self, proposal: RowsProposal, hidden: mx.array, followers: mx.array) -> Any:
        return proposal

    def settle_on_device(self, state: Any, kept: mx.array) -> list[mx.array]:
        raise NotImplementedError(f"{type(self).__name__} settles from counts it has read")

    def take_ended(self, r: int, state: Any, index: int, taken: int, extra: int) -> Proposer:
        raise NotImplementedError(f"{type(self).__name__} settles from counts it has read")


def draw_rows(
    vocab: FullVocab,
    logits: mx.array,
    sampling: list[SamplingSettings],
    keys: list[mx.array | None],
    dists: list[list[mx.array]],
) -> mx.array:
    """Each row's draft [B] int32 from its logits [B, V] (or [B, N] over a subset): the
    argmax for a greedy row, else a draw from its settings' distribution (kept in `dists[r]`,
    over the whole vocabulary, for rejection sampling) by its key. `vocab` maps a subset's
    indices back to token ids."""
    tokens = vocab.token(mx.argmax(logits, axis=-1)).astype(mx.int32)
    if all(s.greedy for s in sampling):
        return tokens
    picks = []
    for r, s in enumerate(sampling):
        if s.greedy:
            picks.append(tokens[r])
            continue
        pick, dist = vocab.draw(s, logits[r], keys[r])
        dists[r].append(dist)
        picks.append(pick)
    return mx.stack(picks)


def one_hot(drafts: list[int], vocab: int) -> mx.array:
    """[K, V] distributions that put all mass on each draft: what a deterministic proposer
    drew its drafts from."""
    rows = mx.arange(vocab)[None, :] == mx.array(drafts, dtype=mx.int32)[:, None]
    return rows.astype(mx.float32)


@dataclass(frozen=True)
class DrafterKind:
    """A drafter that `--draft-model DIR` loads, as its file declares it (`KIND`) and
    `choose.DIRECTORY_DRAFTERS` lists it: `find(spec)` is its directory when `spec` (a
    directory or a Hub repo) is one of this kind, else None; `load(m, spec, where)` loads it,
    checks it against the target `m` (one line naming what does not fit), and returns the
    maker of a fresh proposer for each sequence."""

    name: str  # how outputs and `--json` name it
    find: Callable[[str | Path], Any]
    load: Callable[[MtpModel, str | Path, Any], Callable[[], Proposer]]
