"""Requests decoding together: `BatchSession` is the continuous-batching layer over a
`BatchDecoder`, what `Session` is for one stream. A request joins (`add`: prefilled alone,
then merged into the batch) whenever its caller likes, each `step` is one round over every
row, and a request leaves without stopping the others: finished (an EOS or its
`max_tokens`), stopped (a stop string, `TextStream`), or cancelled (`cancel`).

Each request's text, usage and drafting counts are its own (`BatchEntry`). The engine's
prompt cache is shared with one stream's sessions: a request joins from the longest cached
sequence its prompt extends, and a finished one leaves its state there (`BatchDecoder`).
What one stream has and a batch does not: `max_kv_size` (each row's KV cache grows with its
prompt and output). A request's `depth` is the drafts its row verifies a round (None, with
`adaptive`: chosen per round from the row's own verdicts, 1-3, as one stream chooses it;
None without `adaptive`: 1); `adaptive` also decides per batch width whether
a round drafts at all (`WidthDrafting`), except while a sampled request with a seed is in
the batch: then every round drafts, so that its text is the same alone or in any batch.

A request with oracle drafts (`Request.oracle`, SYNTHETIC: benchmarks) has its row's drafts
and verdicts held to its plan (`oracle.RowOracle`, through the decoder's `draft_filter` and
`plan`), the other rows' as their verify pass says.

An engine that does not draft (`--no-mtp`, a model without a head) decodes its batch with
plain batched steps. Each row drafts with its own proposer from the engine's factory, as one
stream does, joined into the batch's drafter (`Proposer.batched`). A drafter that does not
batch (`batched` gives None) and an engine with `max_kv_size` are refused by `BatchSession`
(`BatchUnsupported`, one line): their requests decode one at a time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mtpkit.core.choices import MAX_DEPTH
from mtpkit.runtime.rollback.rows import BatchUnsupported
from mtpkit.speculative.adaptive import resolve_depth
from mtpkit.speculative.batch.decode import BatchDecoder
from mtpkit.speculative.batch.row import CANCELLED, LENGTH, STOP, Row
from mtpkit.speculative.oracle import RowOracle
from mtpkit.speculative.session import Engine, Request, TokenEvent, check_oracle, check_prompt
from mtpkit.speculative.stats import Stats
from mtpkit.speculative.text import TextStream


@dataclass(eq=False)
class BatchEntry:
    """One request in a `BatchSession`: its row, its text, and why it ended (`stop`,
    `length`, `cancelled`; None while it decodes). `tag` is the caller's (the server's job)."""

    request: Request
    text_stream: TextStream
    proposer: str = "mtp"  # what drafts its row ("none": plain batched steps)
    row: Row | None = None
    tag: Any = None
    generated: int = 0  # tokens handed to the text stream (an EOS excluded)
    finish_reason: str | None = None
    events: list[TokenEvent] = field(default_factory=list)  # not yet taken by `step`/`add`

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.text_stream.text

    @property
    def stats(self) -> Stats:
        """The request's own counts, in the shape one stream reports them."""
        row = self.row
        prompt = len(self.request.prompt)
        if row is None:
            return Stats(prompt_tokens=prompt, proposer=self.proposer)
        stats = copy.deepcopy(row.stats)
        stats.prompt_tokens, stats.proposer, stats.depth = prompt, self.proposer, row.depth
        if row.chooser is not None:  # as one stream reports a chosen depth: the deepest
            stats.depth, stats.depth_chosen = row.chooser.max_depth, True
        stats.generated = list(row.tokens)
        return stats


class BatchSession:
    """Requests on one engine decoding in one batch (see the module's text), drafting with
    the engine's drafter if it batches, or not at all. Usage: `add` requests, then `step` while
    `entries` is not empty; each call returns the entries that have new events
    (`take_events`)."""

    def __init__(self, engine: Engine, *, adaptive: bool = True) -> None:
        if engine.proposers is not None and not _batches(engine):
            raise BatchUnsupported(
                f"the {engine.drafter_name} drafter does not decode in a batch yet: its "
                "requests decode one at a time"
            )
        if engine.max_kv_size is not None:  # a batch's rows keep full caches
            raise BatchUnsupported(
                "--max-kv-size bounds one stream's caches, not a batch's: requests decode "
                "one at a time (drop --max-kv-size to batch them)"
            )
        self.engine = engine
        # Rows choose their depth up to the deepest the head drafts; a round drafts the
        # deepest row's count for all.
        cache = engine.prompt_cache if engine.prompt_cache.size > 0 else None
        self.decoder = BatchDecoder(
            engine.m, depth=MAX_DEPTH, adaptive=adaptive, prompt_cache=cache,
            drafts=engine.drafts, proposers=engine.proposers,
        )  # fmt: skip
        self.entries: list[BatchEntry] = []  # joined and not yet done
        self.oracles: dict[int, RowOracle] = {}  # rows with oracle drafts, by uid

    def add(self, request: Request, tag: Any = None) -> BatchEntry:
        """Prefill `request` and merge it into the batch; its first token's event is in the
        entry's `events`. An entry done at once (max_tokens 0, an EOS or a stop string
        first) never joins."""
        check_prompt(self.engine.m, request.prompt)
        stream = TextStream(self.engine.m.tokenizer, request.stop)
        entry = BatchEntry(request, stream, self.engine.drafter_name, tag=tag)
        if request.max_tokens <= 0:
            self._end(entry, LENGTH)
            return entry
        if request.oracle is not None:
            check_oracle(request, drafts=self.decoder.drafts)
        depth, choose = resolve_depth(request.depth, request.adaptive)
        if not self.decoder.drafts:
            depth = 0  # nothing drafts: a plain step each round, as one stream without a head
        cached = self.engine.prompt_cache.longest_prefix(request.prompt, self.decoder.proposer_name)
        entry.row = self.decoder.add(
            request.prompt, max_tokens=request.max_tokens, sampling=request.sampling,
            seed=request.seed, depth=depth, cached=cached, choose_depth=choose,
        )  # fmt: skip
        if request.oracle is not None:
            self._hold(entry.row, request)
        self._feed(entry, list(entry.row.tokens))
        if not entry.done:
            self.entries.append(entry)
        return entry

    def _hold(self, row: Row, request: Request) -> None:
        """Row `row`'s drafts and verdicts held to its request's oracle (before its first
        round: a row joins between rounds)."""
        m = self.decoder.m
        plan = request.oracle.plan(len(request.prompt), int(m.embedding.weight.shape[0]))
        self.oracles[row.uid] = plan.for_rows()
        self.decoder.draft_filter, self.decoder.plan = self._oracle_drafts, self._oracle_plan

    def _oracle_drafts(self, row: Row, position: mx.array, drafts: mx.array) -> mx.array:
        oracle = self.oracles.get(row.uid)
        return drafts if oracle is None else oracle.drafts(position, drafts)

    def _oracle_plan(self, row: Row, depth: int) -> int | None:
        oracle = self.oracles.get(row.uid)
        return None if oracle is None else oracle.planned(depth)

    def step(self) -> list[BatchEntry]:
        """One round over every request in the batch; the entries with new events (those
        that ended this round included, which leave `entries`)."""
        if not self.entries:
            return []
        # A seeded sampled row's draws are its own only if its key is split the same way
        # whatever its batchmates: rounds that draft every time (adaptive drafting decides
        # by measured time, which no seed repeats).
        seeded = any(
            e.request.seed is not None and not e.request.sampling.greedy for e in self.entries
        )
        new = self.decoder.step(draft=seeded)
        touched = []
        for entry in self.entries:
            self._feed(entry, new.get(entry.row.uid, []))
            if entry.events:
                touched.append(entry)
        self.entries = [e for e in self.entries if not e.done]
        return touched

    def cancel(self, entry: BatchEntry) -> None:
        """End `entry` now (its client left): its row leaves the batch, the others go on."""
        if entry.done:
            return
        if entry.row is not None and not entry.row.done:
            self.decoder.remove(entry.row)
        self._end(entry, CANCELLED)
        self.entries = [e for e in self.entries if e is not entry]

    def reset(self) -> None:
        """Drop every request and the batch's caches (after a failed round, whose caches
        are not to be trusted)."""
        decoder = self.decoder
        self.decoder = BatchDecoder(
            decoder.m, depth=decoder.depth, adaptive=decoder.policy is not None,
            prompt_cache=decoder.prompt_cache, ahead=decoder.ahead, drafts=decoder.drafts,
            proposers=decoder.proposers,
        )  # fmt: skip
        self.entries = []
        self.oracles = {}

    @staticmethod
    def take_events(entry: BatchEntry) -> list[TokenEvent]:
        events, entry.events = entry.events, []
        return events

    def _feed(self, entry: BatchEntry, tokens: list[int]) -> None:
        """Hand the row's new tokens to its text stream, up to a stop string; end the entry
        when its row is done."""
        row = entry.row
        for token in tokens:
            piece = entry.text_stream.add(token)
            entry.generated += 1
            entry.events.append(TokenEvent(token, piece))
            if entry.text_stream.stopped:
                if not row.done:
                    row.finish = STOP  # a stop string: the row leaves as if finished
                    self.decoder.remove(row)
                self._end(entry, STOP)
                return
        if row.done:
            self._end(entry, LENGTH if row.finish == LENGTH else STOP)

    def _end(self, entry: BatchEntry, reason: str) -> None:
        entry.finish_reason = reason
        if entry.row is not None:  # rounds built before it ended asked its plan already
            self.oracles.pop(entry.row.uid, None)
        tail = entry.text_stream.finish() if reason != CANCELLED else ""
        if entry.events:
            entry.events[-1].text += tail
            entry.events[-1].finish_reason = reason
        else:
            entry.events.append(TokenEvent(None, tail, finish_reason=reason))


def _batches(engine: Engine) -> bool:
    """Whether the engine's drafter decodes in a batch (asked of a fresh proposer)."""
    return engine.proposers().batches
