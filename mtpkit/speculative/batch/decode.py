"""Batched speculative decoding: several requests in one round, each row accepting and
rolling back on its own, with any drafter that batches (`proposers.RowsProposer`: the MTP
head, prompt lookup, a draft model, DFlash, EAGLE-3, Gemma 4's assistant).

A row joins (`BatchDecoder.add`) by being prefilled alone, exactly as one stream is (its
prompt, then its last token alone, whose logits give its first token, as mlx-lm's
`generate_step` takes it), with its own proposer from the engine's factory seeing the prefill
as one stream's does (the head's pass over its prompt's pairs, a draft model's prefill;
after a long prompt the head's pass waits for the next step, so the row's first token goes
out first: `row.Joining`); its caches are then merged into the batch's (mlx-lm's `merge`/`extend`: KV caches
left-padded to a common write index, each row with its own offset) and its proposer joins the
batch's drafter (`Proposer.batched`, `RowsProposer.join`). A round (`BatchDecoder.step`): the
drafter drafts for every row, the backbone verifies `[B, K+1]` in one pass, each row gets its
own verdict (greedy, or exact rejection sampling with its own settings), and each row rolls
back to its own accepted prefix (`mtpkit.runtime.rollback.verify_rows`). Where every cache and
the drafter can be rolled back on the device (no sliding window, nothing replayed: the head),
the next round is built and launched before a round's verdicts are read, on its lazy
results, so the host builds while the device computes (`mtpkit.speculative.batch.rounds`).
Rows at different depths share a round: the drafter drafts the deepest row's count for all,
and each row's verdict reads only its own first drafts (a row at depth 0, drafting off or
nothing found by prompt lookup, takes a plain step in the round). With
`adaptive`, a width whose rounds cost more per token than plain batched steps takes plain
steps (`speculative/batch/adaptive.py`). A row that is done (an EOS, its `max_tokens`, or
`remove`) leaves the batch (`filter`) while the others go on.

With a `prompt_cache` (one stream's, `mtpkit.speculative.prompt_cache`, whose entries hold
the target's caches and the proposer's state as one stream's proposer holds it) a row
joins from the entry of the longest sequence its prompt extends, prefilling only the rest;
its prompt's state is kept as it joins, and a row that leaves finished is taken out of the
batch's caches (`extract`) into an entry of its prompt, its output and the EOS that ended it
(a round that ends a row keeps its caches up to there, `_taken`): a conversation's next
turn, alone or in a batch, prefills only what it adds.

Without a drafter (`drafts=False`: `--no-mtp`, a model without a head) every step is a plain
batched step, the next queued before a step's tokens are read, as mlx-lm's `BatchGenerator`
steps; rows join and leave, and keep prompt-cache entries, as they do with the head.

Nothing of one row reaches another: rows share matrix products only, the mask hides every
other row's padding and rejected entries, and each row's verdict reads its own logits.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx

from mtpkit.core.choices import MAX_DEPTH
from mtpkit.runtime.model import GenerateError, MtpModel, NoMtpHead
from mtpkit.runtime.rollback.rows import BatchUnsupported, batch_caches
from mtpkit.runtime.rollback.state import fork_cache
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.adaptive import AUTO_MAX_DEPTH, AdaptiveDrafting
from mtpkit.speculative.batch.adaptive import WidthDrafting
from mtpkit.speculative.batch.draws import draw_rows, sample_first
from mtpkit.speculative.batch.rounds import (
    BuiltRound,
    EndedRow,
    RowDraftFilter,
    RowPlan,
    build_round,
    can_build_ahead,
    ended_row_entry,
)
from mtpkit.speculative.batch.row import CANCELLED, GREEDY, LENGTH, STOP, Joining, Row
from mtpkit.speculative.prompt_cache import CachedState, PromptCache
from mtpkit.speculative.proposers import Proposer, RowsProposer, default_proposer

PREFILL_STEP = 2048


class BatchDecoder:
    """Rows decoding together, drafting up to `depth` tokens a round (see the module's
    text) with the proposers `proposers` makes, one per row (the engine's factory; default:
    the model's MTP head). `draft_filter` replaces each row's drafts (tests, bench's
    oracle), `plan` holds each row's verdict to a count (bench's oracle); `policy` decides
    per width whether a step drafts (`adaptive`: `WidthDrafting`; default: every step
    drafts); `ahead` False reads every round before the next is built. `drafts` False: no
    drafter (`--no-mtp`, a model without a head), every step a plain batched step queued one
    ahead, as mlx-lm's `BatchGenerator` steps."""

    def __init__(
        self,
        m: MtpModel,
        *,
        depth: int,
        draft_filter: RowDraftFilter | None = None,
        plan: RowPlan | None = None,
        adaptive: bool = False,
        policy: WidthDrafting | None = None,
        prompt_cache: PromptCache | None = None,
        ahead: bool = True,
        drafts: bool = True,
        proposers: Callable[[], Proposer] | None = None,
    ) -> None:
        if drafts and proposers is None:
            if m.head is None:
                raise NoMtpHead(f"{m.path} has no MTP head")
            proposers = partial(default_proposer, m)
        self.proposers = proposers if drafts else None
        # The prompt cache's name of what drafts (one stream's `Engine.drafter_name`).
        self.proposer_name = getattr(proposers, "name", "mtp") if drafts else "none"
        if not 0 <= depth <= MAX_DEPTH:
            raise GenerateError(f"depth must be in [0, {MAX_DEPTH}], not {depth}")
        self.drafts = drafts
        depth = depth if drafts else 0
        self.m, self.depth, self.draft_filter, self.plan = m, depth, draft_filter, plan
        self.ahead = ahead
        self.prompt_cache = prompt_cache
        self.eos = set(getattr(m.tokenizer, "eos_token_ids", None) or [])
        self.rows: list[Row] = []  # in the batch's row order (merged ones)
        self.cache: list[Any] | None = None
        self.proposer: RowsProposer | None = None  # the rows' drafter, once a row joined
        self._uids = itertools.count()
        adaptive = adaptive and drafts
        self.policy = policy if policy is not None else WidthDrafting() if adaptive else None
        self.plain_steps = 0
        self.rounds_ahead = 0  # rounds built before the round before them was read
        # A plain step built (and launched) before the previous one's tokens were read, as
        # mlx-lm queues its next step: (tokens [B], hidden [B, 1, H]), lazy.
        self._ahead: tuple[mx.array, mx.array] | None = None
        self._decided: bool | None = None  # the next step's decision, taken when queueing
        # A round built and launched before the previous round was read (`rounds`).
        self._inflight: BuiltRound | None = None
        self._ended: dict[int, EndedRow] = {}  # rows a round rolled on the device ended
        self._stash: dict[int, list[int]] = {}  # tokens confirmed by a join, not yet returned
        self._joining: list[Joining] = []  # rows whose first token is out, not merged yet

    # -- joining --------------------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        sampling: SamplingSettings = GREEDY,
        seed: int | None = None,
        depth: int | None = None,
        cached: CachedState | None = None,
        choose_depth: bool = False,
    ) -> Row:
        """Prefill `prompt` alone (from `cached`, an entry of the prompt cache whose tokens
        it extends, when given), confirm its first token, and merge it into the batch
        (unless that token already ends it). Returns the row; its `tokens` grow as it
        decodes. `seed`: the row samples from its own PRNG key (else MLX's global state);
        `depth`: its drafts a round (default: the decoder's); `choose_depth`: chosen per
        round from the row's own verdicts, up to `depth` or `AUTO_MAX_DEPTH` (one stream's
        adaptive depth, `Row.choose_next`)."""
        from mtpkit.speculative.session import check_prompt

        check_prompt(self.m, prompt)
        if self._ahead is not None or self._inflight is not None:  # queued for the rows before
            taken = self._plain_step(queue=False) if self._ahead is not None else self._drain()
            for uid, tokens in taken.items():
                self._stash[uid] = self._stash.get(uid, []) + tokens
            self._leave()
        depth = self.depth if depth is None else depth
        if not 0 <= depth <= self.depth:
            raise GenerateError(f"a row's depth must be in [0, {self.depth}], not {depth}")
        if max_tokens < 1:
            raise GenerateError(f"max_tokens must be at least 1, not {max_tokens}")
        key = mx.random.key(seed) if seed is not None else None
        chooser = None
        if choose_depth and depth > 0:
            chooser = AdaptiveDrafting(True, min(depth, AUTO_MAX_DEPTH), choose_depth=True)
            depth = chooser.depth
        row = Row(next(self._uids), list(prompt), max_tokens, sampling, depth, key, chooser)
        with mx.stream(_generation_stream()):
            cache, proposer, prefilled = self._prefill(row, cached)
            logits, hidden = self.m.forward(mx.array(prompt[-1:])[None], cache)
            first = sample_first(logits[:, -1, :], sampling, row.next_keys(1)[0])
            row.decoded.append(first)
            joining = Joining(row, cache, proposer, (hidden, first), prefilled)
            if not self._confirm(row, [first]):
                joining.catch_up(self.prompt_cache, self.proposer_name)  # its prompt's entry
            elif prefilled is None:
                self._merge(joining)
            else:  # merged at the next step, once its first token is out (`Joining`)
                self._joining.append(joining)
        return row

    def _prefill(
        self, row: Row, cached: CachedState | None
    ) -> tuple[list[Any], Proposer | None, list[Any] | None]:
        """The target's caches over all of `row`'s prompt but its last token, and the row's
        proposer having seen it (from `cached` on, when given), as one stream's prefill
        leaves them; kept in the prompt cache. Without drafts there is no proposer (None).
        As one stream's, only the caches are computed; where the proposer defers its
        catch-up (`Proposer.defers_catch_up`: the head after a long prompt) it waits for the
        row's first token (`Joining`), and the third item is the target's caches to keep
        then (else None)."""
        prompt = row.prompt
        if cached is not None and self._continues(cached, prompt):
            cache, proposer = cached.fork()
            start = row.stats.cached_tokens = len(cached.tokens) - 1
        else:
            proposer = self.proposers() if self.proposers is not None else None
            cache, start = self.m.make_cache(), 0
        if proposer is not None:
            proposer.attach(cache)
            proposer.begin(prompt, start)
        for i in range(start, len(prompt) - 1, PREFILL_STEP):
            j = min(i + PREFILL_STEP, len(prompt) - 1)
            _, hidden = self.m.forward(mx.array(prompt[i:j])[None], cache)
            mx.eval([c.state for c in cache])
            if proposer is not None:
                proposer.observe(hidden, prompt[i + 1 : j + 1])
        if proposer is not None and proposer.defers_catch_up():
            return cache, proposer, [fork_cache(c) for c in cache]
        if proposer is not None:
            proposer.end_prefill()
        if self.prompt_cache is not None and start < len(prompt) - 1:
            self.prompt_cache.store(prompt, cache, proposer, self.proposer_name)
        return cache, proposer, None

    def _merge(self, joining: Joining) -> None:
        """A prefilled row into the batch: its proposer caught up and over its first
        token's pair."""
        joining.catch_up(self.prompt_cache, self.proposer_name)
        cache, proposer = joining.cache, joining.proposer
        if proposer is not None:
            proposer.observe(joining.pair[0], [joining.pair[1]])
        mx.eval([c.state for c in cache])
        self._join(joining.row, batch_caches([cache]), proposer)

    def _merge_joining(self) -> None:
        """Merge the rows whose first token went out since the last step."""
        joining, self._joining = self._joining, []
        with mx.stream(_generation_stream()):
            for j in joining:
                if j.row.finish != CANCELLED:  # a stop string's row leaves its state
                    self._merge(j)

    def _continues(self, cached: CachedState, prompt: list[int]) -> bool:
        """Whether a row of `prompt` can join from `cached`: its tokens start the prompt,
        it was made by this decoder's kind of proposer (none without drafts) and its caches
        are of the kinds a row's are (an entry of a session with `max_kv_size` holds
        rotating caches)."""
        n = len(cached.tokens)
        kinds = [type(c) for c in self.m.make_cache()]
        return (
            n <= len(prompt) and tuple(prompt[:n]) == cached.tokens
            and cached.proposer_name == self.proposer_name
            and (cached.proposer is None) == (self.proposers is None)
            and [type(c) for c in cached.cache] == kinds
        )  # fmt: skip

    def _join(self, row: Row, cache: list[Any], proposer: Proposer | None) -> None:
        if self.cache is None:
            self.cache = cache
        else:
            for layer, more in zip(self.cache, cache, strict=True):
                layer.extend(more)
        if proposer is not None and self.proposer is not None:
            self.proposer.join(proposer)
        elif proposer is not None:
            self.proposer = proposer.batched()
            if self.proposer is None:
                raise BatchUnsupported(f"the {proposer.name} drafter does not decode in a batch")
            self.proposer.attach(self.cache)
        self.rows.append(row)

    # -- leaving --------------------------------------------------------------------------
    def remove(self, row: Row) -> None:
        """Take `row` out of the batch (cancelled, unless it has finished already)."""
        if row.finish is None:
            row.finish = CANCELLED
        elif any(j.row is row for j in self._joining):  # finished: it leaves its state
            self._merge_joining()
        self._leave()

    def _leave(self) -> None:
        """Drop every finished row from the batch's caches (a row that finished, unless
        cancelled, into the prompt cache first)."""
        keep = [i for i, row in enumerate(self.rows) if not row.done]
        if len(keep) == len(self.rows):
            return
        if self.prompt_cache is not None:
            for r, row in enumerate(self.rows):
                if row.done and row.finish != CANCELLED:
                    self._keep_row(r, row)
        self.rows = [self.rows[i] for i in keep]
        self._ended.clear()
        if not keep:
            self.cache = self.proposer = self._ahead = self._decided = self._inflight = None
            return
        index = mx.array(keep, dtype=mx.int32)
        for layer in self.cache:
            layer.filter(index)
        if self.proposer is not None:
            self.proposer.keep(keep)
        if self._inflight is not None:
            self._inflight.take(index)
        if self._ahead is not None:
            self._ahead = (self._ahead[0][index], self._ahead[1][index])

    def _keep_row(self, r: int, row: Row) -> None:
        """Row r's caches and proposer, taken out of the batch's, as the prompt cache's
        entry of its prompt and `decoded` (its output and EOS). A row that met an EOS while a
        plain step was queued (`_next_is_plain`) has its caches past the EOS: its entry
        takes that step's token too."""
        tokens = row.prompt + row.decoded
        ended = self._ended.pop(row.uid, None)
        if ended is not None:  # a round rolled back on the device ended it
            cache, proposer = ended_row_entry(self, r, row, ended, self._inflight)
            mx.async_eval([c.state for c in cache], [c.state for c in proposer.caches()])
            self.prompt_cache.store(tokens, cache, proposer, self.proposer_name)
            return
        cache = [layer.extract(r) for layer in self.cache]
        proposer = self.proposer.take(r, tokens) if self.proposer is not None else None
        if self._ahead is not None:
            ahead_tokens, ahead_hidden = self._ahead
            token = int(ahead_tokens[r].item())
            tokens = [*tokens, token]
            if proposer is not None:  # the queued step's pair, not seen by the drafter yet
                proposer.observe(ahead_hidden[r : r + 1], [token])
        # Computed now: a lazy slice would hold the whole batch's buffers alive.
        states = [c.state for c in proposer.caches()] if proposer is not None else []
        mx.async_eval([c.state for c in cache], states)
        self.prompt_cache.store(tokens, cache, proposer, self.proposer_name)

    # -- a step: a drafting round or a plain batched step -------------------------------
    def step(self, draft: bool = False) -> dict[int, list[int]]:
        """One drafting round over every row (or, as `policy` decides, a plain batched
        step; `draft`: a round whatever it decides, once a plain step already queued is
        taken); returns each row's new tokens by uid (an EOS and tokens past `max_tokens`
        left out; tokens a join confirmed first). Finished rows leave the batch."""
        self._merge_joining()
        stash, self._stash = self._stash, {}
        if not self.rows:
            return stash
        width = len(self.rows)
        if self._ahead is not None or not self.drafts:  # a queued plain step is taken first
            drafting = False
        elif self._inflight is not None:  # and so is a round built ahead
            drafting = True
        elif self._decided is not None:
            drafting, self._decided = self._decided or draft, None
        else:
            drafting = draft or self.policy is None or self.policy.want_draft(width)
        start = time.perf_counter()
        new = self._round() if drafting else self._plain_step()
        if self.policy is not None:
            seconds = time.perf_counter() - start
            self.policy.record(width, drafting, seconds, sum(len(t) for t in new.values()))
        self._leave()
        for uid, tokens in stash.items():  # a join's tokens come before this step's
            new[uid] = tokens + new.get(uid, [])
        return new

    def _plain_step(self, queue: bool = True) -> dict[int, list[int]]:
        """One backbone step over every row's last token, as mlx-lm's batched step (the
        step queued by the previous one, if any); the drafter is told each row's pair. With
        `queue`, when the next step is plain too, it is built and launched
        before this one's tokens are read, as mlx-lm queues its steps."""
        rows = self.rows
        with mx.stream(_generation_stream()):
            if self._ahead is not None:
                (tokens, hidden), self._ahead = self._ahead, None
            else:
                last = mx.array([[row.last] for row in rows], dtype=mx.int32)
                tokens, hidden = self._plain_forward(last)
            if queue and self._next_is_plain():
                self._ahead = self._plain_forward(tokens[:, None])
                mx.async_eval(self._ahead[0])
            values = tokens.tolist()
            if self.proposer is not None:
                self.proposer.observe(hidden, tokens[:, None])
        self.plain_steps += 1
        new = {}
        for row, token in zip(rows, values, strict=True):
            before = len(row.tokens)
            row.choose_next(0, 0)
            row.decoded.append(token)
            self._confirm(row, [token])
            new[row.uid] = row.tokens[before:]
        return new

    def _plain_forward(self, last: mx.array) -> tuple[mx.array, mx.array]:
        """The backbone over each row's next input [B, 1]: each row's token [B] and the
        hidden state before it [B, 1, H] (lazy)."""
        logits, hidden = self.m.forward(last, self.cache)
        return draw_rows(logits[:, -1, :], self.rows), hidden

    def _next_is_plain(self) -> bool:
        """Whether the step after this plain one is plain too (its decision taken now, in
        the order it would be taken anyway), unless every row ends with this step's token
        (nothing would read the next) or, with a prompt cache, any row does (its caches
        would hold a token past its end, which a next turn's prompt does not extend)."""
        ending = [len(r.tokens) + 1 >= r.max_tokens for r in self.rows]
        if (self.drafts and self.policy is None) or all(ending):
            return False
        if self.prompt_cache is not None and any(ending):
            return False
        return not self.drafts or self._next_is(drafting=False)

    def _next_is(self, *, drafting: bool) -> bool:
        """Whether the next step drafts (`drafting` True) or is plain (False), as the policy
        decides it now, in the order it would anyway (no policy: every step drafts); a
        decision the other way is kept for that step (`_decided`)."""
        wants = self.policy is None or self.policy.want_draft(len(self.rows))
        self._decided = None if wants == drafting else wants
        return wants == drafting

    def _round(self) -> dict[int, list[int]]:
        """A drafting round: the one built ahead, or one built now; the round after it is
        built and launched before this one's verdicts are read where it may be
        (`rounds.can_build_ahead`, and the next step drafts too)."""
        rows = self.rows
        with mx.stream(_generation_stream()):
            built, self._inflight = self._inflight, None
            if built is None:
                last = mx.array([[row.last] for row in rows], dtype=mx.int32)
                positions = mx.array([row.position for row in rows], dtype=mx.int32)
                built = build_round(self, last, positions, ahead=self.ahead)
            ahead = built.last is not None and can_build_ahead(built) and not self._read_first()
            if ahead and self._next_is(drafting=True):
                self._inflight = build_round(self, built.last, built.positions, ahead=True)
                self.rounds_ahead += 1
            return self._read(built)

    def _read_first(self) -> bool:
        """Whether each round is read before the next is built: while a seeded sampled row
        chooses its depth. Its depth (and with it how its key splits) then follows its
        verdicts one round later, whatever joins (a join reads a round built ahead early)."""
        return any(
            r.chooser is not None and r.key is not None and not r.sampling.greedy
            for r in self.rows
        )

    def _drain(self) -> dict[int, list[int]]:
        """Read the round built ahead (a row joins: it was built for the rows before)."""
        built, self._inflight = self._inflight, None
        with mx.stream(_generation_stream()):
            return self._read(built)

    def _read(self, built: BuiltRound) -> dict[int, list[int]]:
        """Read `built`'s verdicts; a round not rolled back yet rolls each row back to what
        it takes. A row that ended (or was cancelled) before this round was read takes
        nothing of it."""
        verdicts = built.verdicts()
        rows = built.rows
        taken = [self._taken(row, v.confirmed) for row, v in zip(rows, verdicts, strict=True)]
        if built.last is None:
            built.verified.rollback(self.cache, taken)
            confirmed = [v.confirmed[:t] for v, t in zip(verdicts, taken, strict=True)]
            self.proposer.settle(built.state, taken, confirmed)
        new = {}
        for i, (row, v) in enumerate(zip(rows, verdicts, strict=True)):
            if row.done:
                continue
            new[row.uid] = self._record(row, v, taken[i])
            if row.done and built.last is not None and self.prompt_cache is not None:
                self._ended[row.uid] = EndedRow(built, i, len(v.confirmed), taken[i])
        return new

    def _record(self, row: Row, v: Verdict, taken: int) -> list[int]:
        """Add `v`'s confirmed tokens to `row` (its caches keep the first `taken`) and count
        its round; returns its new tokens."""
        stats = row.stats
        if v.drafts:
            stats.record_round(row.position, v.drafts, v.accepted)
        else:  # the row's drafting is off: a plain step inside the round (no spec step)
            stats.draft_log.append((row.position, []))
            stats.plain_steps += 1
        row.choose_next(len(v.drafts), v.accepted)
        before = len(row.tokens)
        row.decoded.extend(v.confirmed[:taken])
        self._confirm(row, v.confirmed)
        if row.finish in (STOP, LENGTH) and v.drafts:  # drafts past an EOS or past
            stats.end_round_at(len(row.tokens) - before)  # max_tokens count for nothing
        return row.tokens[before:]

    def _taken(self, row: Row, confirmed: list[int]) -> int:
        """How many of a round's confirmed tokens `row` takes (up to an EOS, included, or its
        `max_tokens`): the verify inputs its caches keep, so that a row that ends holds its
        prompt and output (and EOS) but the last, the state a next turn extends, not the
        tokens the round confirmed past its end."""
        room = row.max_tokens - len(row.tokens)
        for i, token in enumerate(confirmed[:room]):
            if token in self.eos:
                return i + 1
        return min(len(confirmed), room)

    def _confirm(self, row: Row, tokens: list[int]) -> bool:
        """Add confirmed tokens to `row` up to an EOS or its `max_tokens`; False once done."""
        for token in tokens:
            if token in self.eos:
                row.finish = STOP
                return False
            row.tokens.append(token)
            row.last = token
            if len(row.tokens) >= row.max_tokens:
                row.finish = LENGTH
                return False
        return True

    # -- the loop -------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int,
        sampling: SamplingSettings | list[SamplingSettings] = GREEDY,
        seeds: list[int | None] | None = None,
    ) -> list[Row]:
        """Every prompt decoded in one batch until each is done (each with its own settings
        and seed when given lists); the rows in prompt order."""
        settings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        seeds = seeds if seeds is not None else [None] * len(prompts)
        rows = [
            self.add(p, max_tokens=max_tokens, sampling=s, seed=seed)
            for p, s, seed in zip(prompts, settings, seeds, strict=True)
        ]
        while self.rows:
            self.step()
        return rows


def _generation_stream() -> Any:
    from mlx_lm.generate import generation_stream

    return generation_stream
