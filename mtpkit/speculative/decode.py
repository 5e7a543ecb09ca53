"""Lossless speculative decoding: the draft/verify/accept round, with any proposer.

Each round a proposer (`mtpkit.speculative.proposers`: by default the checkpoint's own MTP
head, chaining itself K times; or a draft model, Gemma 4's assistant, prompt lookup) drafts K
tokens, the backbone verifies `[last confirmed token, draft_1..draft_K]` in one forward pass,
and the longest prefix the backbone agrees with is kept, plus the backbone's own next token. Greedy decoding keeps a
draft iff it equals the backbone's argmax, so the output is the backbone's greedy output;
at a temperature, exact rejection sampling keeps the output distribution the backbone's.
After a partial acceptance the caches roll back to the kept prefix (`VerifyPass`).
When drafting loses to plain decoding, `AdaptiveDrafting` pauses it (`speculative/adaptive.py`).
After a long prompt the first token is the target's alone, out before the proposer catches
up with the prompt (`PromptEnd`): the time to first token is the target's prefill.

Pipelined rounds. A round is built and queued (`build_round`: draft, verify, verdict, the
head's step over the verified pairs, all lazy and `mx.async_eval`ed) and its verdict is read
once (`read_round_verdict`). While the head keeps all its drafts most of the time, the next
round is built and queued *before* that read, on the premise that this round keeps all its
drafts (its last verified token and the head's output at its last pair are then known as
lazy arrays), as mlx-lm's `generate_step` queues the next token before reading this one.
When the verdict shows a rejection, the queued round is discarded (`PassUndo` takes its pass
back from every cache, its pairs leave the head's cache) and this round rolls back as usual.
A round can also be only *built* ahead, while the device computes this one, and launched
once this verdict shows every draft kept. Which of the three pays (launched, built, neither)
depends on the share of rounds kept whole and on whether the host or the device is the slower
(`speculative/look_ahead.py`, which times the first serial rounds); only on a GPU (on a CPU
the host's build and a discarded round's compute take the cores that decode). Random draws of a
discarded round are independent of everything kept, so sampling stays exact. Plain steps
that are certain to be followed by another plain step are queued one ahead, as in mlx-lm's
loop: the first of them (after a round) is launched before the next is built, as mlx-lm
launches its first step. No round is looked ahead before one of this generation has kept
every draft: at a head's first verdicts a round built ahead on a false premise costs a
round's host time, which on a GPU that decodes host-bound is most of a round (a useless head
had every one of the rounds adaptive drafting judges it by built twice).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.runtime.model import MtpModel, NoMtpHead
from mtpkit.runtime.rollback.discard import PassUndo, can_discard
from mtpkit.runtime.rollback.state import can_fork, fork_cache
from mtpkit.runtime.rollback.verify_pass import VerifyPass
from mtpkit.speculative.accept import (
    SamplingSettings,
    Verdict,
    followers_of,
    placeholder_verdict,
    read_verdict,
    rejection_sample,
    verdict,
)
from mtpkit.speculative.adaptive import AdaptiveDrafting, DraftingMemory
from mtpkit.speculative.logits import Processor, TokenLogprob, process_rows, token_logprobs
from mtpkit.speculative.look_ahead import LAUNCH_AHEAD, LookAhead
from mtpkit.speculative.proposers import Proposal, Proposer, default_proposer
from mtpkit.speculative.stats import Stats

# SamplingSettings and rejection_sample live in mtpkit.speculative.accept; importable from here too.
__all__ = ["AdaptiveDrafting", "MtpDecoder", "SamplingSettings", "Stats", "rejection_sample"]

# A draft filter: (position of the round's first draft in prompt + output, the proposer's
# drafts [K]) -> the drafts to verify [K] (tests' injected drafts).
DraftFilter = Callable[[int, mx.array], mx.array]


@dataclass
class Round:
    """One drafting round in flight: queued on the device, its verdict not read yet."""

    position: int  # prompt + output tokens before its first draft
    proposal: Proposal
    verified: VerifyPass
    packed: mx.array  # the verdict, read once
    followers: mx.array  # the confirmed token after each verify input
    state: Any  # the proposer's work over the verified pairs (`Proposer.after_verify`)
    undo: PassUndo | None = None  # set when queued on the previous round's premise
    launched: bool = True  # False: built ahead, not on the device yet
    scored: mx.array | None = None  # the verified rows' logits, processed [K+1, V]

    @property
    def depth(self) -> int:
        """Drafts it verifies."""
        return self.proposal.depth

    def launch(self) -> None:
        """Start the round's kernels (its verdict and the proposer's step) on the device."""
        mx.async_eval(self.packed, *([self.state] if isinstance(self.state, mx.array) else []))
        self.launched = True


@dataclass
class PromptEnd:
    """What the proposer has still to see of the prompt while the first token goes out, where
    it defers its catch-up (`Proposer.defers_catch_up`: the head after a long prompt). The
    first token is then the target's alone (its logits at the last prompt token, as mlx-lm's
    prefill ends), and the catch-up (the head's pass over the prompt's pairs, and the
    target's last layer over it that only the head reads) runs after it: the time to first
    token is the target's prefill, as without drafting. `prefilled`: the
    target's caches as the prefill left them, for `after_prefill` (None: not kept); `pair`:
    the first token's hidden state and the token, which the proposer observes once it has
    caught up."""

    prefilled: list[Any] | None
    pair: tuple[mx.array, int] | None = None


class MtpDecoder:
    """One generation: prefill, then drafting rounds (draft, verify, accept, roll back) and
    plain steps until done. `proposer` drafts (default: the model's own MTP head,
    `proposers.default_proposer`); `cache` is the target's (default: a fresh one), of which
    the first `cached` prompt tokens are already in it and seen by the proposer (a session's
    prompt cache). `pipeline`: None decides on a GPU by the share of fully kept rounds and
    the timings of serial rounds (`look_ahead.LookAhead`), True always launches
    ahead, BUILD_AHEAD always builds ahead, False never looks ahead (tests force each);
    `draft_filter` replaces the proposer's drafts (tests). `choose_depth`: adaptive drafting
    picks each round's depth up to `depth` (`speculative/adaptive.py`); `memory`: a greedy
    run goes on from the clear losing verdict an earlier one left there, and leaves its own."""

    def __init__(
        self,
        m: MtpModel,
        prompt: list[int],
        *,
        depth: int,
        sampling: SamplingSettings,
        adaptive: bool,
        use_mtp: bool = True,
        pipeline: bool | str | None = None,
        draft_filter: DraftFilter | None = None,
        max_kv_size: int | None = None,
        choose_depth: bool = False,
        proposer: Proposer | None = None,
        cache: list[Any] | None = None,
        cached: int = 0,
        memory: DraftingMemory | None = None,
    ) -> None:
        if proposer is None and use_mtp:
            if not m.has_head:
                raise NoMtpHead(f"{m.path} has no MTP head")
            proposer = default_proposer(m)
        self.use_mtp = use_mtp and proposer is not None
        self.proposer = proposer
        # Across ranks (`mtpkit.runtime.ranks`) every rank must take the same step: adaptive
        # drafting may decide from each machine's own clock, so there every round drafts.
        self.lockstep = m.lockstep
        adaptive = adaptive and self.use_mtp and self.lockstep.size == 1
        if choose_depth and not adaptive:
            depth, choose_depth = 1, False
        self.m, self.prompt, self.depth, self.sampling = m, prompt, depth, sampling
        priors = {k: proposer.cost_prior(k) for k in range(1, depth + 1)} if proposer else {}
        self.adaptive = AdaptiveDrafting(
            adaptive, depth, timed=sampling.greedy, choose_depth=choose_depth, priors=priors
        )
        # Only a greedy run's text never depends on these decisions: a sampled run's, with
        # a seed, is the same whatever ran before it.
        self.memory = memory if sampling.greedy else None
        if self.memory is not None:
            self.adaptive.resume(self.memory)
        # Whether the proposer was told to rest (`_tell_parked`; None: not told yet, and a
        # proposer from the prompt cache may still rest from its last request).
        self.rested: bool | None = None
        self.round_depth = depth  # of the last drafting round
        self.cache = cache if cache is not None else m.make_cache(max_kv_size)
        if not 0 <= cached < len(prompt):
            raise ValueError(f"cached must be in [0, {len(prompt)}), not {cached}")
        self.cached = cached
        if proposer is not None:
            proposer.attach(self.cache)
            proposer.begin(prompt, cached)
        # The last confirmed token: the backbone has not consumed it yet.
        self.last_token = prompt[-1]
        self._ahead: tuple[mx.array, mx.array] | None = None
        self._queued: Round | None = None  # the next round, queued on speculation
        self.n_confirmed = 0  # tokens confirmed after the prompt
        # They and the EOS that ended them (a round's tokens past its end are not kept).
        self.confirmed: list[int] = []
        self.eos = set(getattr(m.tokenizer, "eos_token_ids", None) or [])
        self.stats = Stats(
            prompt_tokens=len(prompt), depth=depth, depth_chosen=choose_depth,
            proposer=proposer.name if proposer is not None else "none", cached_tokens=cached,
        )  # fmt: skip
        self.sampler = sampling.sampler()
        if pipeline is None and mx.default_device() != mx.gpu:
            pipeline = False  # a CPU computes a discarded round on the cores it decodes on
        if proposer is None or not proposer.looks_ahead:
            pipeline = False
        # Every rank pipelines rounds alike: rank 0's choice, if every rank's caches can
        # take a queued round back (pipeline stages hold different cache kinds).
        discardable = self.lockstep.all_true(can_discard(self.cache))
        pipeline = self.lockstep.share_choice(pipeline) if discardable else False
        # Across ranks each machine's clock may differ: there the share alone decides.
        self.look = LookAhead(pipeline, timed=self.lockstep.size == 1)
        self.draft_filter = draft_filter
        self.after_prefill: Callable[[], None] | None = None  # a session keeps the state
        self._prompt_end: PromptEnd | None = None  # set from the prefill to the catch-up
        self.prefill_step_size = 2048  # tokens per prefill forward (mlx-lm's default)
        # A request's logits processors (`speculative/logits.py`), and the log-probabilities
        # of its tokens (None: not wanted; n: with the top n), one per confirmed token. Both
        # need each round's history, so a session that sets them never looks ahead.
        self.processors: list[Processor] = []
        self.logprobs_top: int | None = None
        self.logprobs: list[TokenLogprob] = []
        self._plain_logits: mx.array | None = None

    @property
    def drafting(self) -> bool:
        """Whether a proposer drafts (not plain decoding)."""
        return self.use_mtp

    def prefill(self, step_size: int | None = None) -> None:
        """All but the last prompt token (after the `cached` ones), in chunks, as mlx-lm's
        `generate_step` does; the last one is the first input of the decoding loop. Then the
        proposer catches up with them, or, inside `events` where it defers that
        (`Proposer.defers_catch_up`), after the first token (`PromptEnd`). As in mlx-lm's
        prefill only the caches are computed: the hidden states the proposer observes stay
        lazy until it catches up, so the target's last layer over the prompt, which only the
        proposer reads, waits for it too. Across ranks they are computed with the caches:
        every rank then takes the collectives in them in the same order, whether its
        proposer reads them or not."""
        from mlx_lm.generate import generation_stream

        start = time.perf_counter()
        prompt = self.prompt
        step_size = step_size or self.prefill_step_size
        with mx.stream(generation_stream):
            for i in range(self.cached, len(prompt) - 1, step_size):
                chunk = prompt[i : min(i + step_size, len(prompt) - 1)]
                _, hidden = self.m.forward(mx.array(chunk)[None], self.cache)
                mx.eval([c.state for c in self.cache], [hidden] if self.lockstep.size > 1 else [])
                if self.proposer is not None:
                    self.proposer.observe(hidden, prompt[i + 1 : i + 1 + len(chunk)])
                mx.clear_cache()
                self.lockstep.tick()
        self.stats.prompt_time = time.perf_counter() - start
        if self.proposer is None:
            return
        end = self._prompt_end
        if end is not None and self.proposer.defers_catch_up():
            if self.after_prefill is not None and can_fork(self.cache):
                end.prefilled = [fork_cache(c) for c in self.cache]
            return
        self._prompt_end = None
        self._end_prefill()

    def _end_prefill(self) -> None:
        from mlx_lm.generate import generation_stream

        with mx.stream(generation_stream):
            self.proposer.end_prefill()

    # -- the round: build and queue, read the verdict once, roll back --------------------
    def build_round(
        self,
        last: mx.array,
        position: int,
        speculative: bool,
        launch: bool = True,
        proposal: Proposal | None = None,
    ) -> Round:
        """Draft (unless `proposal` is given), verify `[last, drafts]`, judge and start the
        proposer's step, all queued on the device (`launch` False: built only,
        `Round.launch` starts it); nothing is read. `speculative`: the previous round's
        verdict is unread, so keep what takes this pass back. Its depth: adaptive drafting's
        choice (else `depth`)."""
        proposer = self.proposer
        undo = None
        if proposal is None:
            depth = self.adaptive.next_depth()
            if speculative:  # unlaunched: the proposer's caches are put back whole too
                caches = self.cache + (proposer.caches() if not launch else [])
                undo = PassUndo.before(caches, depth + 1, unlaunched=not launch)
            proposal = proposer.propose(depth, self.sampling)
        depth = proposal.depth
        drafts = proposal.drafts
        if self.draft_filter is not None and proposer.drafts_locally:
            drafts = self.draft_filter(position, drafts)
        drafts = self.lockstep.share(drafts)  # rank 0's drafts on every rank
        verified = self.m.verify(mx.concatenate([last, drafts]), self.cache)
        scored = verified.logits[0]
        if self.processors:
            scored = process_rows(self.processors, self.prompt + self.confirmed, scored, drafts)
        if proposer.drafts_locally:
            packed, followers = verdict(scored, drafts, proposal.dists, self.sampling)
        else:  # a rank without the head reads rank 0's verdict
            packed = placeholder_verdict(depth, self.sampling.greedy, verified.logits)
        if self.lockstep.size > 1:  # rank 0's verdict, and the followers it implies
            packed = self.lockstep.share(packed, after=[verified.logits])
            followers = followers_of(packed, depth, self.sampling.greedy)
        if launch:
            mx.async_eval(packed)
        state = proposer.after_verify(proposal, verified.hidden, followers, launch)
        return Round(position, proposal, verified, packed, followers, state, undo, launch, scored)

    def read_round_verdict(self, r: Round) -> Verdict:
        """The round's one host read: drafts kept, the backbone's token after them, the
        drafts. Everything after it depends only on this verdict."""
        return self.proposer.judged(read_verdict(r.packed, self.sampling.greedy))

    def discard(self, r: Round) -> None:
        """Take back a round queued on a premise that proved false."""
        if r.launched:
            r.undo.undo(self.cache)
        else:  # nothing of it was computed, and nothing of it will be
            r.undo.undo(self.cache + self.proposer.caches())
        self.proposer.discard(r.state, r.launched)
        self.stats.discarded += 1

    def _look_ahead(self, may_look_ahead: bool) -> str | None:
        """LAUNCH_AHEAD, BUILD_AHEAD or None (the next round waits for this verdict)."""
        if not may_look_ahead or not self.adaptive.want_draft():
            return None
        return self.look.choose()

    def draft_round(
        self, may_look_ahead: bool = False, proposal: Proposal | None = None,
        left: int | None = None,
    ) -> list[int]:  # fmt: skip
        """One drafting round (of `proposal` if given); returns the tokens it confirms (at
        least one). With `may_look_ahead` (more tokens wanted after this round's), the next
        round may be queued before this one's verdict is read. A round whose tokens end the
        generation (an EOS, or `left` tokens wanted) keeps its caches up to there and
        returns no token past it: the caches hold the output and its EOS but the last, the
        state a conversation's next turn extends (`Session`'s prompt cache)."""
        r, self._queued = self._queued, None
        start = time.perf_counter() if r is None else None
        if r is None:
            last = mx.array([self.last_token], dtype=mx.int32)
            position = len(self.prompt) + self.n_confirmed
            r = self.build_round(last, position, False, proposal=proposal)
        queued = None
        if (ahead := self._look_ahead(may_look_ahead)) is not None:
            # Premise: r keeps all its drafts; its last pair is the next round's start.
            self.proposer.assume_kept(r.state)
            launch = ahead == LAUNCH_AHEAD
            position = r.position + r.depth + 1
            queued = self.build_round(r.followers[-1:], position, True, launch=launch)
            self.stats.pipelined += 1
            self.stats.launched_ahead += launch
        queued_at = time.perf_counter()
        v = self.read_round_verdict(r)
        if start is not None and queued is None:  # a serial round: what building ahead saves
            self.look.record_serial(queued_at - start, time.perf_counter() - queued_at)
        full = v.accepted == r.depth
        self.look.record_verdict(full)
        take = self._taken(v.confirmed, left)
        if queued is not None and full and take == len(v.confirmed):
            if not queued.launched:
                queued.undo = None  # its saved arrays go: KV buffers may be updated in place
                queued.launch()
            self._queued = queued  # the premise held: nothing to roll back
            self.proposer.settle(r.state, v, premise_held=True)
        else:
            if queued is not None:
                self.discard(queued)
            kept = Verdict(take - 1, v.confirmed[take - 1], v.drafts, v.targets)
            self.proposer.settle(r.state, kept, premise_held=False)
            r.verified.rollback(self.cache, take)
        self.stats.record_round(r.position, v.drafts, v.accepted)
        self.round_depth = r.depth
        confirmed = v.confirmed[:take]
        if self.logprobs_top is not None:
            self.logprobs.extend(token_logprobs(r.scored, confirmed, self.logprobs_top))
        self.n_confirmed += take
        self.confirmed.extend(confirmed)
        self.last_token = confirmed[-1]
        return confirmed

    def _taken(self, confirmed: list[int], left: int | None) -> int:
        """How many of a round's confirmed tokens the generation takes: up to an EOS
        (included) or the `left` tokens it still wants."""
        room = len(confirmed) if left is None else min(len(confirmed), left)
        for i, token in enumerate(confirmed[:room]):
            if token in self.eos:
                return i + 1
        return room

    # -- plain steps ----------------------------------------------------------------------
    def _plain_forward(self, token: mx.array) -> tuple[mx.array, mx.array]:
        logits, hidden = self.m.forward(token.reshape(1, 1), self.cache)
        logits = logits[:, -1, :]
        if self.processors:  # the history ends with `token` (no step ahead with processors)
            history = mx.array(self.prompt + self.confirmed, dtype=mx.int32)
            for processor in self.processors:
                logits = processor(history, logits)
        self._plain_logits = logits
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        y = self.sampler(logprobs)
        if self.lockstep.size > 1:  # rank 0's token (as int32: every backend sums those)
            y = self.lockstep.share(y.astype(mx.int32))
        return y, hidden

    def plain_step(self, ahead: bool = False) -> list[int]:
        """One backbone step, as mlx-lm's generate_step takes it. With `ahead` (the next
        step is certain to be plain too) the next forward is queued before this token is
        read, so the two overlap as in mlx-lm's own loop."""
        if self._ahead is not None:
            y, hidden = self._ahead
            self._ahead = None
        else:
            y, hidden = self._plain_forward(mx.array([self.last_token]))
            if ahead:  # on the device while the next is built (mlx-lm's first step)
                mx.async_eval(y, hidden)
        if ahead:
            self._ahead = self._plain_forward(y)
            mx.async_eval(*self._ahead)
        token = int(y.item())
        if self.logprobs_top is not None:
            self.logprobs.extend(token_logprobs(self._plain_logits, [token], self.logprobs_top))
        self.last_token = token
        self.n_confirmed += 1
        self.confirmed.append(token)
        if self._prompt_end is not None:  # the first token: observed after the catch-up
            self._prompt_end.pair = (hidden, token)
        elif self.proposer is not None:
            self.proposer.observe(hidden, [token])
        self.stats.plain_steps += 1
        return [token]

    # -- the loop -------------------------------------------------------------------------
    def step(self, left: int) -> list[int]:
        """A drafting round or a plain step, as adaptive drafting and the proposer decide.
        `left`: the tokens still wanted, this step's among them (a queued round pays only if
        tokens past this round's are wanted, a queued plain step if any past this one's)."""
        may_look_ahead = left > self.depth + 1
        self.lockstep.tick()
        if self._prompt_end is not None:
            if self._prompt_end.pair is None:  # the first token, the target's alone
                return self.plain_step()
            self.finish_prefill()
        t0 = time.perf_counter()
        drafting = self.use_mtp and self.adaptive.want_draft() and self._ahead is None
        proposal = None
        if self._queued is None and drafting and self.proposer.can_propose():
            # A proposer that looks ahead drafts inside `build_round` (lazily); others
            # propose now and may find nothing worth a round.
            if not self.proposer.looks_ahead:
                proposal = self.proposer.propose(self.adaptive.next_depth(), self.sampling)
                drafting = proposal is not None
        else:
            drafting = drafting and self._queued is not None
        if self._queued is not None or drafting:
            new = self.draft_round(may_look_ahead, proposal, left)
            self.adaptive.record_round(len(new), time.perf_counter() - t0, self.round_depth)
            self._tell_parked()
            return new
        self._tell_parked()  # (a session may start parked: `memory`)
        ahead = not self.use_mtp or self.adaptive.plain_ahead() > 0
        ahead = ahead and not self.processors and self.logprobs_top is None
        new = self.plain_step(ahead=ahead and left > 1)
        self.adaptive.record_plain(time.perf_counter() - t0)
        return new

    def _tell_parked(self) -> None:
        """Tell the proposer when adaptive drafting parks it (or pauses a drafter that never
        kept a draft), and when it takes it back (`AdaptiveDrafting.resting`)."""
        if self.proposer is not None and self.adaptive.resting != self.rested:
            self.rested = self.adaptive.resting
            self.proposer.rest(self.rested)

    def tokens(self, max_tokens: int) -> Iterator[int]:
        """The confirmed tokens, up to `max_tokens`, until an EOS (not yielded)."""
        return (token for token, _ in self.events(max_tokens))

    @property
    def clean(self) -> bool:
        """Whether the caches hold exactly the confirmed tokens but the last (nothing queued
        ahead, the proposer caught up with the prompt): the state a prompt cache may keep."""
        return self._queued is None and self._ahead is None and self._prompt_end is None

    @property
    def prefilled_cache(self) -> list[Any]:
        """The target's caches as the prefill left them, over the prompt but its last token
        (what `after_prefill` keeps; `PromptEnd`)."""
        end = self._prompt_end
        return end.prefilled if end is not None and end.prefilled is not None else self.cache

    def finish_prefill(self) -> None:
        """The proposer's catch-up with the prompt once the first token is out (`PromptEnd`),
        `after_prefill`, then the first token's pair. Nothing when it has run already."""
        end = self._prompt_end
        if end is None:
            return
        self._end_prefill()
        if self.after_prefill is not None and end.prefilled is not None:
            self.after_prefill()
        self._prompt_end = None
        if end.pair is not None:
            self.proposer.observe(end.pair[0], [end.pair[1]])

    def events(self, max_tokens: int) -> Iterator[tuple[int, bool]]:
        """(token, whether it was a kept draft) as tokens are confirmed, up to `max_tokens`,
        until an EOS (not yielded). Prefills first."""
        from mlx_lm.generate import generation_stream, wired_limit

        eos = self.eos = set(getattr(self.m.tokenizer, "eos_token_ids", None) or [])
        start = time.perf_counter()
        produced, first_done, first_count = 0, None, 0
        with wired_limit(self.m.model, [generation_stream]):
            if self.proposer is not None:  # it may catch up after the first token
                self._prompt_end = PromptEnd(None)
            self.prefill()
            if self._prompt_end is None and self.after_prefill is not None:
                self.after_prefill()
            try:
                with mx.stream(generation_stream):
                    while produced < max_tokens:
                        rounds = self.stats.rounds
                        new = self.step(max_tokens - produced)
                        drafted = self.stats.last_accepted if self.stats.rounds > rounds else 0
                        if first_done is None:
                            first_done, first_count = time.perf_counter(), len(new)
                            self.stats.prompt_time = first_done - start
                        for i, t in enumerate(new):
                            if t in eos:
                                if self.stats.rounds > rounds:
                                    self.stats.end_round_at(i)
                                return
                            self.stats.generated.append(t)
                            produced += 1
                            yield t, i < drafted
                            if produced >= max_tokens:
                                break
            finally:
                if self.memory is not None:
                    self.adaptive.remember(self.memory)
                if first_done is not None:
                    self.stats.decode_time = time.perf_counter() - first_done
                    self.stats.decode_tokens = max(0, len(self.stats.generated) - first_count)
