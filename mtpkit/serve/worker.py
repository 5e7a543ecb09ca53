"""The one thread that decodes: it owns the engine (the model carries process-wide state while
it decodes, so two requests must never build graphs at once) and takes jobs from a bounded
queue, one after another. The HTTP side submits a job and reads its events from an asyncio
queue the worker fills through the event loop (`call_soon_threadsafe`).

A job cancelled while it waits is skipped; one cancelled while it decodes stops before the
next step (`Session.cancel`). With `concurrency` above 1 (`--decode-concurrency`), up to that
many jobs decode together in a `BatchSession` (drafting with the model's head, or plain
batched steps without a drafter): a job joins between rounds when a row is free and leaves
when it ends, the others going on; a job for another model (by path) decodes alone while the
batch waits. An engine whose drafter does not batch yet decodes one job at a time
(`alone_because` says why). With `oracle` (`--oracle-acceptance`, SYNTHETIC), a job of the
served model decodes with oracle drafts where a kept answer covers it, and each answer its
own drafter decoded is kept (`serve/oracle.py`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mtpkit.core.errors import MtpkitError, one_line
from mtpkit.serve.oracle import OracleAnswers
from mtpkit.serve.schemas import Mtp, Outcome, PromptTokensDetails, Usage
from mtpkit.serve.spec_fields import SpeculativeDecoding
from mtpkit.speculative.session import CANCELLED, STOP, Engine, Request, Session

if TYPE_CHECKING:
    from mtpkit.speculative.batch.session import BatchEntry, BatchSession

log = logging.getLogger("mtpkit.serve")

# What a job needs from the engine that decodes it: its request, built (tokenized and checked)
# with that engine's tokenizer and context.
RequestBuilder = Callable[[Engine], Request]


class QueueFull(MtpkitError):
    """Every slot of the queue is taken."""


class ShuttingDown(MtpkitError):
    """The server is stopping and takes no more requests."""


@dataclass
class Failed:
    """A job's end without an answer: `status` is the HTTP status it maps to."""

    status: int
    message: str
    code: str | None = None


@dataclass
class Job:
    """One request's way through the queue; its events arrive on `events`: `TokenEvent`s
    (text pieces), then one `Outcome` or one `Failed`."""

    build: RequestBuilder
    model: str | None  # another model by path (--allow-model-paths), None: the served one
    loop: asyncio.AbstractEventLoop
    # Decoded as one stream even beside a batch: the batch honours no logits processors,
    # log-probabilities or XTC yet (`Request.one_stream`).
    alone: bool = False
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    outbox: Outbox | None = None  # set while the job decodes in the batch

    def cancel(self) -> None:
        """The client went away: skip the job, or stop its decode before the next step."""
        self.cancelled.set()

    def put(self, item: object) -> None:
        if self.outbox is not None:
            self.outbox.items.append((self, item))
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop closed (shutdown): nobody is listening
            pass


class Outbox:
    """The batch's events of one round (or join), handed to the event loop at once: one
    wake-up of the loop per round, not one per row (each wake-up is a write to the loop's
    self-pipe, ~0.1 ms of the decoding thread's time on a CPU host: issue 44's profile)."""

    def __init__(self) -> None:
        self.items: list[tuple[Job, object]] = []

    def flush(self) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, object]]] = {}
        for job, item in self.items:
            by_loop.setdefault(job.loop, []).append((job, item))
        self.items = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop closed (shutdown): nobody is listening
                pass


def _put_all(items: list[tuple[Job, object]]) -> None:
    for job, item in items:
        job.events.put_nowait(item)


class Worker:
    """The decoding thread and its bounded queue (`capacity` waiting jobs)."""

    def __init__(
        self, engine: Engine, *, capacity: int, load: Callable[[str], Engine] | None = None,
        concurrency: int = 1, adaptive: bool = True, oracle: OracleAnswers | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.oracle = oracle
        self.served_engine = engine
        self.load = load  # loads another model by path; None: refused before queuing
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=capacity)
        self.current: Job | None = None
        self.batch: BatchSession | None = None
        self.alone_because: str | None = None  # why `concurrency` above 1 does not batch
        if concurrency > 1:
            from mtpkit.speculative.batch import BatchSession, BatchUnsupported

            try:
                self.batch = BatchSession(engine, adaptive=adaptive)
            except BatchUnsupported as e:
                self.alone_because = str(e)
        self.concurrency = concurrency
        self.active: dict[BatchEntry, Job] = {}  # the batch's jobs
        self.outbox = Outbox()
        self.finished = 0  # jobs answered (/health reports them)
        self.cancelled = 0  # decodes stopped because their client left or the server stops
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mtpkit-decode", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise ShuttingDown("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"all {self.jobs.maxsize} queue slots are taken: retry later") from None

    def begin_shutdown(self) -> None:
        """Take no more jobs; cancel those waiting and the one decoding (signal-safe)."""
        self.stopping.set()
        current = self.current
        if current is not None:
            current.cancel()
        for job in list(self.active.values()):
            job.cancel()

    @property
    def decoding(self) -> bool:
        return self.current is not None or bool(self.active)

    def stop(self) -> None:
        """Shut down and wait for the thread to end."""
        self.begin_shutdown()
        while True:  # the waiting jobs are answered, then the thread is told to end
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.put(Failed(503, "the server is shutting down", "shutting_down"))
        self.jobs.put(None)
        self.thread.join()

    def _run(self) -> None:
        if self.batch is not None:
            self._run_batched(self.batch)
            return
        while (job := self.jobs.get()) is not None:
            if self._skipped(job):
                continue
            self._alone(job)

    def _skipped(self, job: Job) -> bool:
        """Answer a job that will not decode (the server stops, its client left)."""
        if self.stopping.is_set():
            job.put(Failed(503, "the server is shutting down", "shutting_down"))
            return True
        if job.cancelled.is_set():  # its client left while it waited
            self.cancelled += 1
            job.put(Failed(503, "the request was cancelled", "cancelled"))
            return True
        return False

    def _alone(self, job: Job) -> None:
        """Decode one job as a single stream, its failure its own answer."""
        self.current = job
        try:
            self._decode(job)
        except MtpkitError as e:
            job.put(Failed(400, str(e)))
        except Exception as e:  # the server lives on; this request gets a 500
            log.exception("decoding failed")
            job.put(Failed(500, one_line(e), "internal_error"))
        finally:
            self.current = None

    def _run_batched(self, batch: BatchSession) -> None:
        """Rounds over the batch's jobs; between rounds, a waiting job joins while a row is
        free: one a round while others decode, so that a queue of prompts prefills between
        their rounds rather than stalling them all (a join's prefill was 74% of the thread's
        time at 16 clients on a CPU, issue 44). The thread sleeps on the queue only while the
        batch is empty."""
        while True:
            joined = 0
            while len(self.active) < self.concurrency and not (joined and self.active):
                try:
                    job = self.jobs.get(block=not self.active)
                except queue.Empty:
                    break
                if job is None:  # stop(): the batch's jobs were cancelled by begin_shutdown
                    self._batch_round(batch)
                    return
                if self._skipped(job):
                    continue
                if job.model is not None or job.alone:  # decoded alone, the batch waits
                    self._alone(job)
                    continue
                self._join(batch, job)
                joined += 1
            self._batch_round(batch)

    def _join(self, batch: BatchSession, job: Job) -> None:
        job.outbox = self.outbox
        try:
            self._add(batch, job)
        finally:
            self.outbox.flush()

    def _add(self, batch: BatchSession, job: Job) -> None:
        try:
            entry = batch.add(self._request(job, self.served_engine), tag=job)
        except MtpkitError as e:
            job.put(Failed(400, str(e)))
            return
        except Exception as e:
            log.exception("prefill failed")
            job.put(Failed(500, one_line(e), "internal_error"))
            return
        self.active[entry] = job
        self._deliver(batch, entry)

    def _batch_round(self, batch: BatchSession) -> None:
        """Cancel the rows whose clients left, then one round; every job with news gets it."""
        try:
            self._round(batch)
        finally:
            self.outbox.flush()

    def _round(self, batch: BatchSession) -> None:
        for entry, job in list(self.active.items()):
            if job.cancelled.is_set():
                batch.cancel(entry)
                self._deliver(batch, entry)
        try:
            touched = batch.step()
        except Exception as e:  # the batch's caches are not to be trusted: all rows end
            log.exception("batched decoding failed")
            for job in self.active.values():
                job.put(Failed(500, one_line(e), "internal_error"))
            self.active.clear()
            batch.reset()
            return
        for entry in touched:
            self._deliver(batch, entry)

    def _deliver(self, batch: BatchSession, entry: BatchEntry) -> None:
        """Hand the entry's text to its job; once it ended, its outcome (or its failure)."""
        job = entry.tag
        for event in batch.take_events(entry):
            if event.text and entry.finish_reason != CANCELLED:
                job.put(event)
        if not entry.done:
            return
        self.active.pop(entry, None)
        self._answer(job, self.served_engine, entry, entry.generated)

    def _engine_for(self, job: Job) -> Engine:
        """The engine of the job's model: the served one, or another loaded by path (the
        served model stays loaded; one other at most beside it, replaced by the next)."""
        if job.model is None:
            if self.engine is not self.served_engine:
                self.engine = self.served_engine
            return self.engine
        if self.load is None:
            raise MtpkitError("loading models by path is off (start with --allow-model-paths)")
        if str(Path(self.engine.m.path).resolve()) != job.model:
            log.info("loading %s", job.model)
            self.engine = self.load(job.model)
        return self.engine

    def _decode(self, job: Job) -> None:
        engine = self._engine_for(job)
        session = engine.session(self._request(job, engine))
        tokens = 0
        for event in session:
            tokens += event.token is not None
            if job.cancelled.is_set():
                session.cancel()
            if event.text or event.logprob is not None:
                job.put(event)
        self._answer(job, engine, session, tokens)

    def _request(self, job: Job, engine: Engine) -> Request:
        """The job's request, with oracle drafts where the server's oracle has them."""
        request = job.build(engine)
        if self.oracle is not None and job.model is None:
            return self.oracle.planned(request)
        return request

    def _answer(
        self, job: Job, engine: Engine, session: Session | BatchEntry, generated: int
    ) -> None:
        """A finished request's last word: its outcome, or 503 when it was cancelled (its
        client left, or the server is stopping)."""
        if session.finish_reason == CANCELLED:
            self.cancelled += 1
            if self.stopping.is_set():
                job.put(Failed(503, "the server is shutting down", "shutting_down"))
            else:
                job.put(Failed(503, "the request was cancelled", "cancelled"))
            return
        self.finished += 1
        if self.oracle is not None and job.model is None:
            self.oracle.record(session)
        job.put(outcome(engine, session, generated))


def outcome(engine: Engine, session: Session | BatchEntry, generated: int) -> Outcome:
    """Usage and the mtp object of a finished session that yielded `generated` tokens."""
    stats, request = session.stats, session.request
    # As mlx_lm.server counts: the EOS that ended generation is a completion token.
    eos = session.finish_reason == STOP and not session.text_stream.stopped
    completion = generated + (eos and generated < request.max_tokens)
    prompt = len(request.prompt)
    usage = Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
    )
    drafts = engine.drafts
    mtp = Mtp(
        drafter=stats.proposer if drafts else "none",
        depth=stats.depth if drafts else 0,
        drafted=stats.drafted,
        accepted=stats.accepted,
        acceptance=stats.acceptance,
        synthetic_acceptance=request.oracle.acceptance if request.oracle is not None else None,
    )
    spec = SpeculativeDecoding.from_stats(stats) if drafts else None
    reason = "length" if session.finish_reason == "length" else "stop"
    scored = None
    if request.logprobs is not None and isinstance(session, Session):
        decoder = session.decoder
        scored = list(zip(decoder.confirmed, decoder.logprobs, strict=False))[:completion]
    return Outcome(text=session.text, finish_reason=reason, usage=usage, mtp=mtp, scored=scored,
        spec=spec,
    )
