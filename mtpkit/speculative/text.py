"""Tokens to text pieces, with stop strings: a piece is handed out only once no stop string
can begin in it, and the text ends before the first stop string (the OpenAI API's `stop`)."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Detokenizes as tokens come (mlx-lm's streaming detokenizer) and holds back any tail
    that could be the start of a stop string."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stop = tuple(s for s in stop if s)
        self.held = ""  # decoded text not handed out yet
        self.text = ""  # handed out
        self.stopped = False

    def add(self, token: int) -> str:
        """The new text piece after `token` (maybe empty); sets `stopped` at a stop string."""
        self.detokenizer.add_token(token)
        return self._release(self.detokenizer.last_segment)

    def finish(self) -> str:
        """The rest of the text once decoding ended."""
        if self.stopped:
            return ""
        self.detokenizer.finalize()
        piece = self._release(self.detokenizer.last_segment, final=True)
        return piece

    def _release(self, segment: str, final: bool = False) -> str:
        held = self.held + segment
        cut = min((i for i in (held.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            piece, self.held = held[:cut], ""
        elif final or not self.stop:
            piece, self.held = held, ""
        else:
            keep = _partial_stop_length(held, self.stop)
            piece, self.held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += piece
        return piece


def _partial_stop_length(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that begins some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest
