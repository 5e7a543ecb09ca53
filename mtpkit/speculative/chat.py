"""A conversation on an engine, turn by turn (`mtpkit chat`, as `mlx_lm.chat`): the messages
so far through the chat template, each answer decoded by a session. The engine's prompt cache
keeps the earlier turns' state, so each turn prefills only what it adds."""

from __future__ import annotations

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
    messages: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the prompt cache keeps what it holds)."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.messages = system

    def turn(self, text: str) -> Session:
        """The session that answers `text`; iterate it for the answer's pieces, then
        `remember` its text."""
        self.messages.append({"role": "user", "content": text})
        tokens = encode_messages(self.engine.m.tokenizer, self.messages)
        request = Request(tokens, self.max_tokens, self.sampling, self.seed, depth=self.depth)
        return self.engine.session(request)

    def remember(self, answer: str) -> None:
        self.messages.append({"role": "assistant", "content": answer})


def turn_summary(session: Session) -> str:
    """The line after each answer: what drafted, its acceptance, the prompt tokens reused."""
    stats = session.stats
    reused = f"{stats.cached_tokens}/{stats.prompt_tokens} prompt tokens from the cache"
    if stats.proposer == "none":
        return f"[plain decoding; {reused}]"
    acceptance = "n/a" if stats.acceptance is None else f"{stats.acceptance:.1%}"
    name = {"mtp": "MTP", "draft-model": "draft model", "prompt-lookup": "prompt lookup"}
    drafter = name.get(stats.proposer, stats.proposer)
    return f"[{drafter}: acceptance {acceptance} ({stats.accepted}/{stats.drafted}); {reused}]"
