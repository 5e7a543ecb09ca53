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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

if TYPE_CHECKING:
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

    def cost_prior(self, depth: int) -> float | None:
        """A round's cost at `depth` in plain target steps, for adaptive drafting (None:
        the backend's prior for the MTP head)."""
        ...

    def fork(self) -> Proposer:
        """A proposer in this one's state that changes on its own from now on (a session's
        prompt cache keeps one per cached prefix)."""
        ...


class ProposerBase:
    """Defaults for the optional parts of `Proposer`."""

    name = "proposer"
    looks_ahead = False
    drafts_locally = True

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


def one_hot(drafts: list[int], vocab: int) -> mx.array:
    """[K, V] distributions that put all mass on each draft: what a deterministic proposer
    drew its drafts from."""
    rows = mx.arange(vocab)[None, :] == mx.array(drafts, dtype=mx.int32)[:, None]
    return rows.astype(mx.float32)
