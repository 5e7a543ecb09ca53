"""Gemma 4's MTP assistant as the proposer (`--draft-model ASSISTANT` beside a Gemma 4 target).

The assistant keeps no cache of its own: each round it reads the target's KV cache (the last
non-shared layer of each attention type, `mtpkit.runtime.assistant.TargetReader`) as the
decoder left it after the last verdict, and drafts from the last confirmed token and the
target's final-normed hidden state at the position before it, as transformers'
`SinglePositionMultiTokenCandidateGenerator` does: the query at the confirmed token's index
for every step, each next step fed the drafted token and `post_projection` of the last.
In a batch, `gemma4_assistant_rows.AssistantRows` reads each row's own entries the same way.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtpkit.core.choices import POST_NORM
from mtpkit.families.gemma4_assistant import Gemma4AssistantModel
from mtpkit.runtime.assistant import TargetReader
from mtpkit.runtime.model import MtpModel
from mtpkit.speculative.accept import SamplingSettings, Verdict
from mtpkit.speculative.proposers.base import DrafterKind, Proposal, ProposerBase


class AssistantProposer(ProposerBase):
    """Drafts with a Gemma 4 assistant over the target `m`'s caches (see the module's text).
    `step_cost`: a draft step's share of a target step, for adaptive drafting."""

    name = "gemma4-assistant"
    batches = True  # `batched`: `gemma4_assistant_rows.AssistantRows`

    def __init__(
        self, m: MtpModel, assistant: Gemma4AssistantModel, step_cost: float | None = None
    ) -> None:
        text = m.config.get("text_config") or m.config
        self.m, self.assistant = m, assistant
        self.reader = TargetReader.of(text, m.embedding)
        # The assistant reads the final norm's output (transformers' `hidden_states[-1]`);
        # nothing else of a Gemma 4 target reads the tapped hidden state.
        m.hidden = POST_NORM
        self.target_cache: list[Any] = []
        self.hidden: mx.array | None = None  # [1, 1, H_b] before the last confirmed token
        self.last_token = 0  # the last confirmed token: not in the target's cache yet
        self.step_cost = step_cost

    def attach(self, cache: list[Any]) -> None:
        self.target_cache = cache

    def observe(self, hidden: mx.array, tokens: list[int]) -> None:
        self.hidden = hidden[:, -1:]  # the state that predicted the last of `tokens`
        self.last_token = tokens[-1]

    def can_propose(self) -> bool:
        return self.hidden is not None and bool(self.target_cache)

    def position(self) -> int:
        """The last confirmed token's index: the tokens in the target's cache."""
        return int(self.target_cache[self.reader.sources["full_attention"]].offset)

    def propose(self, depth: int, sampling: SamplingSettings) -> Proposal:
        assert self.hidden is not None, "propose before any confirmed state"
        kv = self.reader.kv(self.target_cache)
        position = self.position()
        token = mx.array([[self.last_token]], dtype=mx.int32)
        hidden = self.hidden
        drafts, dists = [], []
        for _ in range(depth):
            embedded = self.reader.embed(token)
            h, hidden = self.assistant.hidden_step(
                embedded, hidden.astype(embedded.dtype), kv, position
            )
            if sampling.greedy:
                token = self.assistant.greedy(h).astype(mx.int32)
            else:
                q = sampling.probs(self.assistant.logits(h)[0, -1])
                token = mx.random.categorical(mx.log(q)).astype(mx.int32).reshape(1, 1)
                dists.append(q)
            drafts.append(token.reshape(1))
        return Proposal(mx.concatenate(drafts), mx.stack(dists) if dists else None)

    def begin(self, prompt: list[int], cached: int) -> None:
        # Until the target has computed a token, there is no hidden state to draft from (a
        # one-token prompt, or a prompt cache holding all but the last): a plain step first.
        self.last_token = prompt[-1]
        self.hidden = None

    def after_verify(
        self, proposal: Proposal, hidden: mx.array, followers: mx.array, launch: bool
    ) -> mx.array:
        return hidden

    def settle(self, state: mx.array, verdict: Verdict, premise_held: bool) -> None:
        """The next round drafts from the target's state at the last kept input."""
        kept = verdict.accepted
        self.hidden = state[:, kept : kept + 1]
        self.last_token = verdict.token

    def cost_prior(self, depth: int) -> float | None:
        if self.step_cost is None:
            return None
        from mtpkit.speculative.adaptive import prior_cost

        return prior_cost(depth) + depth * self.step_cost

    def batched(self) -> Any:
        from mtpkit.speculative.proposers.gemma4_assistant_rows import AssistantRows

        return AssistantRows(self)


def _load(m: MtpModel, spec: Any, where: Any) -> Any:
    from mtpkit.runtime.assistant import check_pairs, load_assistant
    from mtpkit.runtime.headload import parameter_bytes
    from mtpkit.speculative.proposers.target import share_of

    assistant = load_assistant(where)
    check_pairs(assistant.config, m.config, (str(spec), m.path.name))
    share = share_of(m, parameter_bytes(assistant))
    return lambda: AssistantProposer(m, assistant, share)


def _find(spec: Any) -> Any:
    from mtpkit.runtime.assistant import assistant_directory

    return assistant_directory(spec)


KIND = DrafterKind("gemma4-assistant", _find, _load)
