"""`mtpkit bench --draft-model DIR`: stock mlx-lm's speculative decoding with a separate draft
model, the alternative to a built-in head that mlx-engine (LM Studio), vllm-metal and
vllm-mlx's first speculative PR offer, measured in the same interleaved trials as the MTP
runs so the table says which is faster for this model.

The run is `mlx_lm.stream_generate(..., draft_model=..., num_draft_tokens=K)` on the stock
load of the target directory that `speed.py` already times; its acceptance is the share of
tokens that came from the draft model, and its rate counts the tokens after its first round
over the time since that round's first token, as mtpkit's rows count theirs
(`speed.mtp_run`). mlx-lm's own `generation_tps` counts every token over that time, the
first round's K+1 included, which gives a drafting run up to K free tokens (3 of 128 at
K = 3: its figure read ~2% high against the rows beside it).
mlx-lm can only speculate when every layer's cache can be trimmed: hybrid models (Qwen3.5's
gated delta nets, Qwen3-Next) cannot, and the row then says why instead of a number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.bench.report import Figure
from mtpkit.core.errors import MtpkitError
from mtpkit.runtime.model import library_io, load_backbone, resolve_model_path
from mtpkit.runtime.upcast import upcast_experts

DEFAULT_DRAFT_TOKENS = 3


@dataclass
class DraftModelRun:
    """Stock mlx-lm decoding with a draft model: rate, speedup over stock, acceptance."""

    path: str
    num_draft_tokens: int
    decode_tps: Figure = field(default_factory=Figure)
    speedup: Figure = field(default_factory=Figure)
    drafted: int = 0  # tokens of the last trial that came from the draft model
    generated: int = 0
    unavailable: str | None = None  # why mlx-lm cannot speculate on this target

    @property
    def acceptance(self) -> float | None:
        return self.drafted / self.generated if self.generated else None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "num_draft_tokens": self.num_draft_tokens,
            "decode_tps": self.decode_tps.median if self.decode_tps.values else None,
            "decode_tps_range": self.decode_tps.range if self.decode_tps.values else None,
            "speedup": self.speedup.median if self.speedup.values else None,
            "speedup_range": self.speedup.range if self.speedup.values else None,
            "tokens_from_draft": self.acceptance,
            "unavailable": self.unavailable,
        }


class DraftModelBench:
    """The draft model, loaded once; `run` measures one trial on the stock target."""

    def __init__(self, path: str | Path, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS) -> None:
        if num_draft_tokens < 1:
            raise MtpkitError(f"--num-draft-tokens must be at least 1, not {num_draft_tokens}")
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise MtpkitError(f"--draft-model {path} is not a model directory (no config.json)")
        # mtpkit's own loading, as for the model itself: config, headers and tokenizer
        # validated, a raw checkpoint's head set aside, never remote code.
        try:
            with library_io():
                self.model, self.tokenizer, _ = load_backbone(resolve_model_path(str(directory)))
        except MtpkitError as e:
            raise MtpkitError(f"--draft-model {path}: {e}") from None
        upcast_experts([self.model], what=str(directory))
        self.result = DraftModelRun(str(path), num_draft_tokens)

    def check_target(self, target: Any, tokenizer: Any) -> None:
        """Why mlx-lm cannot speculate with this pair, recorded (not raised) when it cannot."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        if self.tokenizer.vocab_size != tokenizer.vocab_size:
            raise MtpkitError(
                f"--draft-model {self.result.path} has a vocabulary of {self.tokenizer.vocab_size} "
                f"tokens, the model {tokenizer.vocab_size}: a draft model must share the "
                "model's tokenizer"
            )
        cache = make_prompt_cache(target)
        if not can_trim_prompt_cache(cache):
            kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
            self.result.unavailable = (
                f"mlx-lm cannot speculate on this model: its {', '.join(kinds)} layers cannot "
                "be rolled back"
            )

    def run(self, target: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> float:
        """One decode: its tok/s after its first round (the module's text), the tokens it
        drafted kept."""
        import mlx_lm

        if self.result.unavailable:
            return 0.0
        start = end = 0.0
        drafted, generated, first_round = 0, 0, None
        for response in mlx_lm.stream_generate(
            target, tokenizer, mx.array(prompt), max_tokens=max_tokens,
            draft_model=self.model, num_draft_tokens=self.result.num_draft_tokens,
        ):  # fmt: skip
            end = time.perf_counter()
            start = start or end
            generated += 1
            drafted += bool(response.from_draft)
            if first_round is None and not response.from_draft:  # a round ends on the target's
                first_round = generated
        self.result.drafted, self.result.generated = drafted, generated
        after = generated - (first_round or generated)
        return after / (end - start) if after and end > start else 0.0

    def record(self, rate: float, base: float) -> None:
        """A trial's decode: its rate, and its ratio to `base` (stock's rate at its time)."""
        self.result.decode_tps.values.append(rate)
        self.result.speedup.values.append(rate / base if base else 0.0)
