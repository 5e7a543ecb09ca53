"""`mtpkit serve --oracle-acceptance A` (SYNTHETIC, for benchmarks): oracle drafts in the
server's own paths, so that a random model's real size is measured as a head of acceptance A
would serve it (`mtpkit bench --serve --acceptance A`).

A greedy request's answer is the backbone's greedy continuation of its prompt, so the server
keeps every answer it decoded with its own drafter (`OracleAnswers.record`); a later greedy
request of the same prompt that the kept answer covers (as many tokens, or its EOS) decodes
with oracle drafts over it (`speculative/oracle.py`: the head runs and costs what it costs,
its drafts and verdicts are held to a seeded plan right at a share A). A bench sends each
prompt once untimed first. A request that no kept answer covers decodes with the head, its
answer kept; its response's `mtp.synthetic_acceptance` is null where an oracle's is A.

The verdict is held to the plan, so the text is the greedy one only where the backbone's
verify pass and its plain steps agree (CPU, float32: token for token); on a GPU in bf16 a
random model's near-tied logits part ways within a few tokens and the text may differ. A
sampled request, or one with logits processors (whose continuation is not the kept one),
is refused by the field that asks for it.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

from mtpkit.core.errors import MtpkitError
from mtpkit.speculative.oracle import Oracle
from mtpkit.speculative.session import CANCELLED, Request, Session

if TYPE_CHECKING:
    from mtpkit.speculative.batch.session import BatchEntry

# Prompts whose answers are kept, least recently used first out: a bench's prompts are fewer.
ANSWERS_KEPT = 4096
# The request fields whose processors change the greedy continuation (`LogitsSettings`).
PROCESSOR_FIELDS = ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty")


class OracleRefused(MtpkitError):
    """A request oracle drafts cannot decode (`param` names the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class OracleAnswers:
    """The answers kept by prompt and the oracle's share `acceptance` (see the module's
    text). Used on the decoding thread only (`planned`, `record`), but for `check`."""

    def __init__(self, acceptance: float, eos: set[int]) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise MtpkitError(f"--oracle-acceptance must be in [0, 1], not {acceptance}")
        self.acceptance = acceptance
        self.eos = eos
        self.answers: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    @staticmethod
    def check(request: Request) -> None:
        """Refuse, by its field, what oracle drafts cannot decode."""
        if not request.sampling.greedy:
            raise OracleRefused(
                "temperature", "the server's --oracle-acceptance holds drafts to the greedy "
                "continuation: only greedy requests (temperature 0) are served",
            )  # fmt: skip
        for name in PROCESSOR_FIELDS:
            if getattr(request.logits, name):
                raise OracleRefused(
                    name, "the server's --oracle-acceptance holds drafts to the plain greedy "
                    "continuation, which logits processors change",
                )  # fmt: skip

    def planned(self, request: Request) -> Request:
        """`request` with oracle drafts where a kept answer covers it, else as it is."""
        key = tuple(request.prompt)
        reference = self.answers.get(key)
        if reference is None or not self._covers(reference, request.max_tokens):
            return request
        self.answers.move_to_end(key)
        seed = zlib.crc32(repr(key).encode())  # each prompt its own plan, every run alike
        return replace(request, oracle=Oracle(reference, self.acceptance, seed))

    def record(self, session: Session | BatchEntry) -> None:
        """Keep a finished answer that the server's own drafter decoded (a `Session`, or a
        batch's `BatchEntry`): its tokens up to the EOS that ended it, included."""
        request = session.request
        if request.oracle is not None or session.finish_reason == CANCELLED:
            return
        tokens = _decoded(session)
        for i, token in enumerate(tokens):
            if token in self.eos:
                tokens = tokens[: i + 1]
                break
        key = tuple(request.prompt)
        kept = self.answers.get(key)
        if kept is not None and not self._longer(tokens, kept):
            return
        self.answers[key] = tuple(tokens)
        self.answers.move_to_end(key)
        while len(self.answers) > ANSWERS_KEPT:
            self.answers.popitem(last=False)

    def _covers(self, reference: tuple[int, ...], max_tokens: int) -> bool:
        return len(reference) >= max_tokens or bool(reference and reference[-1] in self.eos)

    def _longer(self, tokens: list[int], kept: tuple[int, ...]) -> bool:
        ended = bool(kept and kept[-1] in self.eos)
        return not ended and len(tokens) > len(kept)


def _decoded(session: Session | BatchEntry) -> list[int]:
    """The tokens a one-stream session or a batch's entry confirmed (an EOS included)."""
    if isinstance(session, Session):
        return list(session.decoder.confirmed)
    return list(session.row.decoded) if session.row is not None else []
