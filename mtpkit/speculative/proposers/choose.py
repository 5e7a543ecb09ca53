"""Which proposer drafts, from what the user asked for: the model's own MTP head by default, a
drafter from a directory (`--draft-model`: an EAGLE-3 or DFlash drafter or a Gemma 4
assistant, recognised from its config.json, else a draft model; `DIRECTORY_DRAFTERS`), or
prompt lookup (`--prompt-lookup`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import MtpModel
from mtpkit.speculative.proposers import Proposer, default_proposer
from mtpkit.speculative.proposers.base import DrafterKind
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


# The drafters `--draft-model DIR` recognises, tried in this order: each is a file of this
# package with its `KIND` (`base.DrafterKind`); the last, a draft model, takes any model.
# Adding one is its file and its line here.
DIRECTORY_DRAFTERS = (
    "eagle3",
    "dflash",
    "gemma4_assistant",
    "draft_model",
)


def directory_drafter(spec: str | Path) -> tuple[DrafterKind, Any]:
    """The kind of drafter `spec` is, and where it is (the first kind that finds it)."""
    for module in DIRECTORY_DRAFTERS:
        kind = importlib.import_module(f"{__package__}.{module}").KIND
        where = kind.find(spec)
        if where is not None:
            return kind, where
    raise MtpkitError(f"{spec} is no drafter mtpkit reads")  # the draft model takes any


class ProposerFactory:
    """Makes a fresh proposer per sequence for one target; a drafter from a directory is
    loaded once and checked against the target (its tokenizer, its layers) before any
    decoding."""

    def __init__(self, m: MtpModel, choice: DrafterChoice) -> None:
        self.m, self.choice = m, choice
        self.kind: DrafterKind | None = None
        self._make: Callable[[], Proposer] | None = None
        if choice.draft_model is not None:
            self.kind, where = directory_drafter(choice.draft_model)
            self._make = self.kind.load(m, choice.draft_model, where)
        if choice.prompt_lookup:  # the option check, before any decoding
            self._prompt_lookup()

    @property
    def name(self) -> str:
        return self.kind.name if self.kind is not None else self.choice.name

    def _prompt_lookup(self) -> Proposer:
        from mtpkit.speculative.proposers.prompt_lookup import PromptLookupProposer
        from mtpkit.speculative.proposers.target import logits_width

        c = self.choice
        return PromptLookupProposer(logits_width(self.m), c.prompt_lookup_min, c.prompt_lookup_max)

    def __call__(self) -> Proposer:
        if self._make is not None:
            return self._make()
        if self.choice.prompt_lookup:
            return self._prompt_lookup()
        return default_proposer(self.m)
