"""`mtpkit generate`: prompt in, text out, with the checkpoint's MTP head, another drafter
(a draft model, prompt lookup) or none.

The stages live beside this module: `mtpkit.runtime.model` loads stock mlx-lm's backbone and the
head and taps the backbone, `mtpkit.speculative.session` runs a request on the decoder
(`decode`) with a proposer (`proposers/`). Plain decoding (`--no-mtp`) is stock mlx-lm's
`stream_generate`, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.core.choices import TOP_P_OFF, require_depth
from mtpkit.core.errors import UnsupportedFamily
from mtpkit.core.prompts import encode_prompt
from mtpkit.families import Family, family_for
from mtpkit.runtime.model import GenerateError, MtpModel, NoMtpHead, load_model
from mtpkit.runtime.sharded import load_sharded, world
from mtpkit.speculative.adaptive import resolve_depth
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings, Stats
from mtpkit.speculative.plain import MLX_LM_DEFAULTS, MlxLmOptions, stock_tokens
from mtpkit.speculative.proposers.choose import DrafterChoice
from mtpkit.speculative.session import (
    GREEDY,
    HEAD,
    STOP,
    Engine,
    PromptTooLong,
    Request,
    Session,
    check_prompt,
    check_seed,
)

# A head that drafted this many tokens and had none accepted is likely broken (NaN, wrong
# weights): a head that keeps half its drafts does so by chance once in 256 runs.
BROKEN_HEAD_DRAFTS = 8


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    drafted: int
    accepted: int
    acceptance_by_depth: list[float | None]
    # None when no token came after the first (its time is the prompt's, as in mlx-lm).
    decode_tps: float | None
    prompt_tps: float
    peak_memory_gb: float
    mtp: bool
    depth: int  # the deepest depth a round could draft at (0: no MTP)
    moe_dtype: str | None = None
    # Drafting rounds at depth 1, 2, ... (adaptive drafting chooses it without --depth).
    rounds_by_depth: list[int] = field(default_factory=list)
    depth_chosen: bool = False
    drafter: str = "mtp"  # what drafted: "mtp" (the head), "draft-model", "prompt-lookup", "none"
    finish_reason: str = "length"  # "stop" (an EOS or a stop string) or "length"
    # As mlx-lm counts them: the generated tokens plus the EOS that ended them.
    generation_tokens: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.tokens),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "acceptance_by_depth": self.acceptance_by_depth,
            "decode_tps": self.decode_tps,
            "prompt_tps": self.prompt_tps,
            "peak_memory_gb": self.peak_memory_gb,
            "mtp": self.mtp,
            "depth": self.depth,
            "depth_chosen": self.depth_chosen,
            "rounds_by_depth": self.rounds_by_depth,
            "moe_dtype": self.moe_dtype,
            "drafter": self.drafter,
            "finish_reason": self.finish_reason,
            "generation_tokens": self.generation_tokens,
        }


def stream_tokens(
    m: MtpModel,
    prompt: list[int],
    *,
    max_tokens: int = 256,
    mtp: bool = True,
    depth: int | None = None,
    sampling: SamplingSettings = GREEDY,
    adaptive: bool = True,
    seed: int | None = None,
    max_kv_size: int | None = None,
    drafter: DrafterChoice = HEAD,
) -> tuple[Iterator[int], Callable[[], Stats]]:
    """Token ids as they are confirmed, and a function giving the run's statistics.
    `depth` None: adaptive drafting chooses each round's (1..AUTO_MAX_DEPTH; without
    `adaptive`, 1). `max_kv_size` bounds the attention caches as mlx-lm's does; `drafter`:
    what drafts (default: the head)."""
    require_depth(resolve_depth(depth, adaptive)[0])
    check_prompt(m, prompt)
    if seed is not None:
        mx.random.seed(seed)
    if seed is None and m.lockstep.size > 1:  # stock decoding samples on every rank
        mx.random.seed(m.lockstep.share_int(int(mx.random.randint(0, 2**31 - 1).item())))
    if not mtp:
        return stock_tokens(
            m, prompt, max_tokens=max_tokens, sampling=sampling, max_kv_size=max_kv_size
        )
    session = _session(m, prompt, max_tokens, depth, sampling, adaptive, max_kv_size, drafter)
    tokens = (event.token for event in session if event.token is not None)
    return tokens, lambda: session.stats


def _session(
    m: MtpModel,
    prompt: list[int],
    max_tokens: int,
    depth: int | None,
    sampling: SamplingSettings,
    adaptive: bool,
    max_kv_size: int | None,
    drafter: DrafterChoice,
) -> Session:
    """One request on an engine of its own (no prompt cache: one request)."""
    engine = Engine(m, drafter=drafter, mtp=True, prompt_cache_size=0, max_kv_size=max_kv_size)
    request = Request(prompt, max_tokens, sampling, depth=depth, adaptive=adaptive)
    return engine.session(request)


def generate(
    model: str | Path | MtpModel,
    prompt: str | list[int],
    *,
    max_tokens: int = 256,
    mtp: bool | str = True,
    depth: int | None = None,
    temp: float = 0.0,
    top_p: float = TOP_P_OFF,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    seed: int | None = None,
    hidden: str | None = None,
    adaptive: bool = True,
    chat_template: bool = True,
    system_prompt: str | None = None,
    prefill_response: str | None = None,
    max_kv_size: int | None = None,
    extra_eos_tokens: Sequence[str] = (),
    on_token: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
    pipeline: bool = False,
    drafter: DrafterChoice = HEAD,
    options: MlxLmOptions = MLX_LM_DEFAULTS,
    adapter_path: str | None = None,
    chat_template_args: dict[str, Any] | None = None,
    default_chat_template: bool = False,
) -> GenerationResult:
    """Generate from a model directory with (or without) its MTP head, or another drafter.

    `mtp` is True (the head is required), False, or "auto" (use the head when there is one,
    else warn and decode plainly); `drafter` picks a draft model or prompt lookup instead of
    the head. `on_token` receives text segments as they are decoded. Under `mlx.launch`
    each rank loads its part (`mtpkit.runtime.sharded`; `pipeline` picks pipeline stages
    where the model also has tensor parallelism) and every rank returns the same result.
    The sampling, prompt and cache options mean what mlx_lm.generate's do (`seed` is set
    before the model loads, as mlx_lm.generate sets it); each of `extra_eos_tokens` (a token
    or an id) also ends generation; `options` carries mlx_lm.generate's others
    (`MlxLmOptions`), `adapter_path` its LoRA adapters, `chat_template_args` its
    --chat-template-config.
    """
    loads = not isinstance(model, MtpModel)
    check_seed(seed)
    sampling = SamplingSettings.checked(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep
    )
    if mtp is True and options.plain_only():
        raise GenerateError(f"{options.plain_only_reason()}: add --no-mtp")
    if seed is not None and loads:  # as mlx_lm.generate: loading draws from the generator
        mx.random.seed(seed)
    m = load_target(model, mtp=mtp, hidden=hidden, pipeline=pipeline, drafter=drafter,
                    adapter_path=adapter_path)  # fmt: skip
    use_mtp = bool(mtp) if not drafter.uses_head else use_head(m, mtp, warn)
    if use_mtp and options.plain_only():  # --mtp auto with a head: say why it is plain
        (warn or (lambda s: print(f"Warning: {s}", file=sys.stderr)))(
            f"{options.plain_only_reason()}: decoding without drafting"
        )
        use_mtp = False
    add_eos_tokens(m, extra_eos_tokens)
    tokens = prompt_tokens(
        m, prompt, chat_template=chat_template, system_prompt=system_prompt,
        prefill_response=prefill_response, template_args=chat_template_args,
        default_template=default_chat_template,
    )  # fmt: skip
    sampling = sampling.fitted(m.vocab_size)
    check_prompt(m, tokens)
    mx.reset_peak_memory()
    if not use_mtp:
        if seed is not None and not loads:
            mx.random.seed(seed)
        it, stats_fn = stock_tokens(
            m, tokens, max_tokens=max_tokens, sampling=sampling, max_kv_size=max_kv_size,
            options=options,
        )  # fmt: skip
        text = detokenize(m.tokenizer, it, on_token)
        return generation_result(m, text, stats_fn(), False, max_tokens)
    require_depth(resolve_depth(depth, adaptive)[0])
    if not loads and seed is not None:
        mx.random.seed(seed)
    if seed is None and m.lockstep.size > 1:  # every rank samples alike
        mx.random.seed(m.lockstep.share_int(int(mx.random.randint(0, 2**31 - 1).item())))
    session = _session(m, tokens, max_tokens, depth, sampling, adaptive, max_kv_size, drafter)
    session.decoder.prefill_step_size = options.prefill_step_size
    for event in session:
        if on_token is not None and event.text:
            on_token(event.text)
    result = generation_result(
        m, session.text, session.stats, True, max_tokens, session.finish_reason
    )
    _warn_if_never_accepted(m, result, drafter, warn)
    return result


def prompt_tokens(
    m: MtpModel, prompt: str | list[int], *, chat_template: bool = True,
    system_prompt: str | None = None, prefill_response: str | None = None,
    template_args: dict[str, Any] | None = None, default_template: bool = False,
) -> list[int]:  # fmt: skip
    """The prompt's token ids as mlx_lm.generate builds them (ids are taken as they are)."""
    if isinstance(prompt, list):
        return prompt
    if default_template and getattr(m.tokenizer, "chat_template", None) is None:
        # mlx_lm.generate --use-default-chat-template, where the tokenizer has a default.
        default = getattr(m.tokenizer, "default_chat_template", None)
        if default is not None:
            m.tokenizer.chat_template = default
    return encode_prompt(
        m.tokenizer, prompt, chat_template=chat_template, system_prompt=system_prompt,
        prefill_response=prefill_response, template_args=template_args,
    )  # fmt: skip


def load_target(
    model: str | Path | MtpModel, *, mtp: bool | str, hidden: str | None, pipeline: bool,
    drafter: DrafterChoice, adapter_path: str | None = None,
) -> MtpModel:  # fmt: skip
    """The target: as given, one rank's part under `mlx.launch`, or loaded (with its head
    when the head drafts)."""
    with_head = mtp is not False and drafter.uses_head
    if isinstance(model, MtpModel):
        return model
    if (group := world()) is not None:  # one rank of `mlx.launch`
        if adapter_path is not None:
            raise GenerateError(
                "--adapter-path is not supported across ranks: fuse the adapter first (mlx_lm.fuse)"
            )
        if not drafter.uses_head:
            raise GenerateError(
                f"--{drafter.name} is not supported across ranks yet: draft with the MTP head "
                "(the default) or run on one machine"
            )
        return load_sharded(model, group, pipeline=pipeline, hidden=hidden, with_head=with_head)
    return load_model(model, hidden=hidden, with_head=with_head, adapter_path=adapter_path)


def _warn_if_never_accepted(
    m: MtpModel, result: GenerationResult, drafter: DrafterChoice,
    warn: Callable[[str], None] | None,
) -> None:  # fmt: skip
    """One warning when the head drafted many tokens and none was kept (a broken head: NaN
    or wrong weights decode at plain speed at best, without a word otherwise)."""
    if not drafter.uses_head or result.drafted < BROKEN_HEAD_DRAFTS or result.accepted:
        return
    message = (
        f"the MTP head of {m.path.name} drafted {result.drafted} tokens and none was accepted: "
        f"it is likely broken; run `mtpkit check {m.path}`"
    )
    (warn or (lambda s: print(f"Warning: {s}", file=sys.stderr)))(message)


def generation_result(
    m: MtpModel, text: str, stats: Stats, use_mtp: bool, max_tokens: int,
    finish_reason: str | None = None,
) -> GenerationResult:  # fmt: skip
    """A decode's result from its counts (`stats`), as mlx-lm reports one: `finish_reason`
    None means stock decoding, which ends early only at an EOS."""
    depth = stats.depth
    generated = len(stats.generated)
    if finish_reason is None:  # stock decoding ends early only at an EOS
        finish_reason = STOP if generated < max_tokens else "length"
    # mlx-lm counts the EOS that ended generation among the generated tokens.
    counted = generated + (finish_reason == STOP and generated < max_tokens)
    return GenerationResult(
        text=text,
        tokens=list(stats.generated),
        prompt_tokens=stats.prompt_tokens,
        drafted=stats.drafted,
        accepted=stats.accepted,
        acceptance_by_depth=stats.acceptance_by_depth(depth) if use_mtp else [],
        decode_tps=stats.decode_tokens / stats.decode_time
        if stats.decode_tokens and stats.decode_time > 0
        else None,
        prompt_tps=stats.prompt_tokens / stats.prompt_time if stats.prompt_time > 0 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        mtp=use_mtp,
        depth=depth if use_mtp else 0,
        moe_dtype=m.moe_dtype,
        rounds_by_depth=stats.rounds_by_depth[:depth] if use_mtp else [],
        depth_chosen=stats.depth_chosen and use_mtp,
        drafter=stats.proposer if use_mtp else "none",
        finish_reason=finish_reason,
        generation_tokens=counted,
    )


def add_eos_tokens(m: MtpModel, tokens: Sequence[str]) -> None:
    """mlx_lm.generate's --extra-eos-token: each (a token or an id) also ends generation."""
    for token in tokens:
        try:
            m.tokenizer.add_eos_token(token)
        except ValueError:
            raise GenerateError(
                f"--extra-eos-token {token!r} is not a token of {m.path.name}'s tokenizer: "
                "pass a token as the tokenizer spells it, or its id"
            ) from None


def use_head(m: MtpModel, mtp: bool | str, warn: Callable[[str], None] | None) -> bool:
    """Whether to draft: `mtp` True needs a head, "auto" falls back to plain with a warning."""
    if not mtp or m.has_head:
        return bool(mtp)
    family = family_or_none(m.config)
    if family is not None and not family.ships_head:
        # A dense decoder (Llama, Qwen3, ...): no published checkpoint has a head to keep.
        fix = f"{family.name} models ship none: train one with `mtpkit train-head {m.path} -o OUT`"
    else:
        fix = "run `mtpkit inspect` on it, and `mtpkit convert` the original checkpoint to keep its head"
    message = (
        f"{m.path} has no MTP head (no mtp/weights.safetensors sidecar and no mtp.* "
        f"tensors in its shards): {fix}"
    )
    if mtp != "auto":
        raise NoMtpHead(message)
    (warn or (lambda s: print(f"Warning: {s}", file=sys.stderr)))(
        message + "; decoding without MTP"
    )
    return False


def family_or_none(config: dict[str, Any]) -> Family | None:
    try:
        return family_for(config)
    except UnsupportedFamily:
        return None


def detokenize(
    tokenizer: Any, tokens: Iterator[int], on_token: Callable[[str], None] | None
) -> str:
    """The text of `tokens`, handing each decoded segment to `on_token` as it comes."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for t in tokens:
        detokenizer.add_token(t)
        if on_token is not None and (segment := detokenizer.last_segment):
            on_token(segment)
    detokenizer.finalize()
    if on_token is not None and (segment := detokenizer.last_segment):
        on_token(segment)
    return detokenizer.text


def measure_acceptance(
    model_dir: str | Path,
    prompts: list[str],
    *,
    max_tokens: int = 64,
    hidden: str | None = None,
    concat_order: str | None = None,
    norm_shift: float = 0.0,
    chat_template: bool = True,
) -> float:
    """Greedy depth-1 acceptance of the head over `prompts`, drafting at every step.

    `hidden` (pre_norm/post_norm), `concat_order` (embedding_first/hidden_first) and
    `norm_shift` (added to every head RMSNorm weight) override what the manifest records,
    so a check can measure what a different conversion decision would give.
    """
    m = load_model(model_dir, hidden=hidden, concat_order=concat_order, norm_shift=norm_shift)
    drafted, accepted = head_counts(m, prompts, max_tokens=max_tokens, chat_template=chat_template)
    return accepted / drafted if drafted else 0.0


def head_counts(
    m: MtpModel, prompts: Sequence[str], *, max_tokens: int, chat_template: bool = True
) -> tuple[int, int]:
    """The head's drafted and accepted tokens over `prompts`: greedy, depth 1, drafting at
    every step (what `measure_acceptance` and check's probes report)."""
    if m.head is None:
        raise NoMtpHead(f"{m.path} has no MTP head: run `mtpkit inspect` and `mtpkit convert`")
    drafted = accepted = 0
    for text in prompts:
        tokens = encode_prompt(m.tokenizer, text, chat_template=chat_template)
        check_prompt(m, tokens)
        decoder = MtpDecoder(m, tokens, depth=1, sampling=SamplingSettings(), adaptive=False)
        for _ in decoder.tokens(max_tokens):
            pass
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    return drafted, accepted


__all__ = [
    "Engine",
    "MlxLmOptions",
    "GenerationResult",
    "Request",
    "PromptTooLong",
    "check_prompt",
    "generate",
    "head_counts",
    "measure_acceptance",
    "stream_tokens",
]
