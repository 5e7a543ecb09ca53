"""Which proposer drafts, from what the user asked for: the model's own MTP head by default, a
draft model (`--draft-model`; a Gemma 4 assistant, a DFlash block drafter or an EAGLE-3
drafter is recognised from its config.json), or prompt lookup (`--prompt-lookup`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import MtpModel
from mtpkit.speculative.proposers import Proposer, default_proposer
from mtpkit.speculative.proposers.prompt_lookup import DEFAULT_MAX_N, DEFAULT_MIN_N


@dataclass(frozen=True)
class DrafterChoice:
    """What drafts: `draft_model` (a path or Hub repo), else `prompt_lookup`, else the head."""

    draft_model: str | Path | None = None
    prompt_lookup: bool = False
    prompt_lookup_min: int = DEFAULT_MIN_N
    prompt_lookup_max: int = DEFAULT_MAX_N

    def __post_init__(self) -> None:
        if self.draft_model is not None and self.prompt_lookup:
            raise MtpkitError("--draft-model and --prompt-lookup are two drafters: pass one")

    @property
    def uses_head(self) -> bool:
        return self.draft_model is None and not self.prompt_lookup

    @property
    def name(self) -> str:
        if self.draft_model is not None:
            return "draft-model"
        return "prompt-lookup" if self.prompt_lookup else "mtp"


class ProposerFactory:
    """Makes a fresh proposer per sequence for one target; a draft model is loaded once and
    checked against the target's tokenizer before any decoding."""

    def __init__(self, m: MtpModel, choice: DrafterChoice) -> None:
        self.m, self.choice = m, choice
        self.vocab = m.embedding.weight.shape[0] if hasattr(m.embedding, "weight") else None
        self.draft = None
        self.assistant = None
        self.dflash = None
        self.eagle3 = None
        if choice.draft_model is not None:
            self._load_draft_model(choice.draft_model)
        if choice.prompt_lookup:  # the option check, before any decoding
            self._prompt_lookup()

    def _load_draft_model(self, spec: str | Path) -> None:
        """A Gemma 4 assistant (checked to pair with the target), a DFlash block drafter
        (checked to read this target), else a draft model (checked to share its tokenizer)."""
        from mtpkit.runtime.assistant import assistant_directory, check_pairs, load_assistant
        from mtpkit.runtime.dflash import check_target, dflash_directory, load_dflash
        from mtpkit.runtime.eagle3 import eagle3_directory

        if (where := eagle3_directory(spec)) is not None:
            self._load_eagle3(spec, where)
            return
        where = dflash_directory(spec)
        if where is not None:
            self.dflash = load_dflash(where)
            names = (str(spec), self.m.path.name)
            check_target(self.dflash, self.m.config, self._embedding_rows(), names)
            return
        where = assistant_directory(spec)
        if where is not None:
            self.assistant = load_assistant(where)
            names = (str(spec), self.m.path.name)
            check_pairs(self.assistant.config, self.m.config, names)
            return
        from mtpkit.speculative.proposers.draft_model import check_compatible, load_draft_model

        self.draft = load_draft_model(spec)
        check_compatible(self.m, self.draft)

    def _load_eagle3(self, spec: str | Path, where: Path) -> None:
        from mtpkit.runtime.eagle3 import check_target, load_eagle3

        self.eagle3 = load_eagle3(where)
        names = (str(spec), self.m.path.name)
        check_target(self.eagle3, self.m.config, self._embedding_rows(), names)

    @property
    def name(self) -> str:
        if self.eagle3 is not None:
            return "eagle3"
        if self.dflash is not None:
            return "dflash"
        return "gemma4-assistant" if self.assistant is not None else self.choice.name

    def _embedding_rows(self) -> int:
        """The token ids the target's embedding has rows for."""
        weight = getattr(self.m.embedding, "weight", None)  # quantized too: [V, packed]
        return int(weight.shape[0]) if weight is not None else self._target_vocab()

    def _target_vocab(self) -> int:
        """The width of the target's logits (a probe of one token through its output head)."""
        import mlx.core as mx

        width = self.m.lm_head(mx.zeros((1, 1, self.m.embed(mx.array([[0]])).shape[-1]))).shape[-1]
        return int(width)

    def _prompt_lookup(self) -> Proposer:
        from mtpkit.speculative.proposers.prompt_lookup import PromptLookupProposer

        c = self.choice
        return PromptLookupProposer(self._target_vocab(), c.prompt_lookup_min, c.prompt_lookup_max)

    def __call__(self) -> Proposer:
        if self.eagle3 is not None:
            from mtpkit.speculative.proposers.eagle3 import Eagle3Proposer

            share = self.eagle3.parameter_bytes / max(1, _parameter_bytes(self.m))
            return Eagle3Proposer(self.m, self.eagle3, share)
        if self.dflash is not None:
            from mtpkit.speculative.proposers.dflash import DFlashProposer

            share = self.dflash.parameter_bytes / max(1, _parameter_bytes(self.m))
            return DFlashProposer(self.m, self.dflash, share)
        if self.assistant is not None:
            from mlx.utils import tree_flatten

            from mtpkit.speculative.proposers.gemma4_assistant import AssistantProposer

            size = sum(v.nbytes for _, v in tree_flatten(self.assistant.parameters()))
            return AssistantProposer(
                self.m, self.assistant, size / max(1, _parameter_bytes(self.m))
            )
        if self.draft is not None:
            from mtpkit.speculative.proposers.draft_model import DraftModelProposer

            step_cost = self.draft.parameter_bytes / max(1, _parameter_bytes(self.m))
            return DraftModelProposer(self.draft, self._target_vocab(), step_cost)
        if self.choice.prompt_lookup:
            return self._prompt_lookup()
        return default_proposer(self.m)


def _parameter_bytes(m: MtpModel) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(m.model.parameters()))
