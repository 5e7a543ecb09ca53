"""A conversation on an engine, turn by turn (`mtpkit chat`, as `mlx_lm.chat`): each answer
decoded by a session, the engine's prompt cache keeping the earlier turns' state, so each turn
prefills only what it adds.

As `mlx_lm.chat` keeps its KV cache, a turn continues the tokens the model last consumed and
produced (the previous prompt and the answer's own tokens) with what the chat template adds
for the new message. A template that renders a past answer otherwise than it was generated
(Qwen3's, which drops the empty `<think></think>` block a thinking-off turn opens with) would
otherwise change the conversation's start every turn, and nothing could be reused."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mtpkit.core.prompts import encode_messages
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.session import Engine, Request, Session


@dataclass
class Conversation:
    engine: Engine
    system_prompt: str | None = None
    max_tokens: int = 256
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    seed: int | None = None
    depth: int | None = None
    prefill_step_size: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    # The tokens the model consumed and produced up to the last answer's end (None: render
    # the whole conversation, as after a reset or an answer cut short mid-round).
    history: list[int] | None = None

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the prompt cache keeps what it holds)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = system
        self.history = None

    def turn(self, text: str) -> Session:
        """The session that answers `text`; iterate it for the answer's pieces, then
        `remember` it."""
        self.messages.append({"role": "user", "content": text})
        request = Request(
            self.prompt(), self.max_tokens, self.sampling, self.seed, depth=self.depth
        )
        session = self.engine.session(request)
        if self.prefill_step_size is not None:
            session.decoder.prefill_step_size = self.prefill_step_size
        return session

    def prompt(self) -> list[int]:
        """The new turn's prompt: the history so far and what the template adds for the new
        message (the whole rendered conversation where there is no history, or where the
        template's rendering of the past does not end where the new one continues)."""
        tokenizer = self.engine.tokenizer
        full = encode_messages(tokenizer, self.messages)
        if self.history is None:
            return full
        past = encode_messages(tokenizer, self.messages[:-1], add_generation_prompt=False)
        if full[: len(past)] != past:
            return full
        return self.history + full[len(past) :]

    def remember(self, session: Session) -> None:
        """Keep the answer `session` decoded: its text as the assistant's message, its tokens
        as the history the next turn continues (where the caches hold them)."""
        self.messages.append({"role": "assistant", "content": session.text})
        decoder = session.decoder
        clean = decoder.clean and session.finish_reason is not None
        self.history = session.request.prompt + decoder.confirmed if clean else None


@contextlib.contextmanager
def interrupt_ends_answer(session: Session) -> Iterator[None]:
    """Ctrl-C while an answer streams ends that answer only, at the next decoding step (as
    mlx_lm.chat's); outside an answer Ctrl-C keeps its meaning. Only the main thread can
    take a signal, so elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: session.cancel())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def turn_summary(session: Session) -> str:
    """The line after each answer: what drafted, its acceptance, the prompt tokens reused."""
    stats = session.stats
    reused = f"{stats.cached_tokens}/{stats.prompt_tokens} prompt tokens from the cache"
    if session.finish_reason == "cancelled":
        reused += "; answer stopped"
    if stats.proposer == "none":
        return f"[plain decoding; {reused}]"
    acceptance = "n/a" if stats.acceptance is None else f"{stats.acceptance:.1%}"
    name = {"mtp": "MTP", "draft-model": "draft model", "prompt-lookup": "prompt lookup"}
    drafter = name.get(stats.proposer, stats.proposer)
    return f"[{drafter}: acceptance {acceptance} ({stats.accepted}/{stats.drafted}); {reused}]"
