"""A model loaded once, decoding one request after another: the library's session, which
`generate`, `chat` and the server (`mtpkit.serve`) all run on, as `mlx_lm.server` runs on
`stream_generate`.

`Engine` holds the target, the drafter chosen for it (a proposer made per request) and the
prompt cache. `Engine.session(request)` makes a `Session`: the target's cache and the
proposer's state (restored from the prompt cache when the prompt extends a cached sequence),
the sampler, adaptive drafting and statistics; iterating it decodes and yields a
`TokenEvent` per token (its text piece, whether it was a kept draft, the finish reason on
the last). The model carries process-wide state while it decodes (its tapped hidden states,
class swaps during a verify pass), so one thread decodes at a time: the server's decoding
thread owns the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtpkit.core.choices import TOP_P_OFF, require_depth
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_messages, encode_prompt
from mtpkit.runtime.model import GenerateError, MtpModel, NoMtpHead, load_model
from mtpkit.speculative.accept import SamplingSettings
from mtpkit.speculative.adaptive import DraftingMemory, resolve_depth
from mtpkit.speculative.decode import MtpDecoder, Stats
from mtpkit.speculative.logits import NO_PROCESSING, LogitsSettings, TokenLogprob
from mtpkit.speculative.oracle import Oracle
from mtpkit.speculative.prompt_cache import DEFAULT_SIZE, PromptCache
from mtpkit.speculative.proposers.choose import DrafterChoice, ProposerFactory
from mtpkit.speculative.text import TextStream

GREEDY = SamplingSettings()
HEAD = DrafterChoice()  # the model's own MTP head
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


class EngineThreadError(MtpkitError):
    """An Engine used from a thread other than the one that decodes on it."""


def _check_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise GenerateError(f"{name} must be an integer of {least} or more, not {value!r}")


class PromptTooLong(MtpkitError):
    """The prompt does not fit the model's context."""


def check_seed(seed: int | None) -> None:
    """A seed MLX's generator takes: an integer in [0, 2**64)."""
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64
    ):
        raise GenerateError(f"the seed must be an integer from 0 to 2**64 - 1, not {seed!r}")


def check_prompt(m: MtpModel, prompt: list[int]) -> None:
    """A prompt of token ids the model can take: not empty, integers inside its vocabulary
    (an id past it would read past the embedding), shorter than its context."""
    if not prompt:
        raise GenerateError("the prompt is empty")
    vocab = m.vocab_size
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, int):
            raise GenerateError(f"a prompt of token ids holds {token!r}, not an integer id")
        if token < 0 or (vocab is not None and token >= vocab):
            last = "" if vocab is None else f" (0..{vocab - 1})"
            raise GenerateError(f"token id {token} is not in the model's vocabulary{last}")
    if m.context_length and len(prompt) >= int(m.context_length):
        raise PromptTooLong(
            f"the prompt has {len(prompt)} tokens but {m.path.name} has a context of "
            f"{m.context_length}: shorten the prompt"
        )


def check_oracle(request: Request, *, drafts: bool) -> None:
    """Oracle drafts hold each verdict to the greedy reference: a greedy request whose
    engine drafts (one stream or a batch's row)."""
    if not request.sampling.greedy:
        raise GenerateError("oracle drafts follow the greedy continuation: sample at temp 0")
    if request.logits.processes:
        raise GenerateError("oracle drafts follow the plain greedy continuation: no processors")
    if not drafts:
        raise GenerateError("oracle drafts replace a drafter's: this engine does not draft")


@dataclass(frozen=True)
class Request:
    """One decode: the prompt's token ids and how to continue it. `depth` None: adaptive
    drafting chooses each round's (1-3; without `adaptive`, 1). `stop`: strings that end
    the text (not included in it). `logits`: processors and XTC (`speculative/logits.py`);
    `logprobs`: None, or each token's log-probability with the top `logprobs` others.
    `oracle`: SYNTHETIC drafts for benchmarks (`speculative/oracle.py`: the drafter runs,
    its drafts and verdicts are held to the oracle's plan over a greedy reference)."""

    prompt: list[int]
    max_tokens: int = 256
    sampling: SamplingSettings = GREEDY
    seed: int | None = None
    stop: tuple[str, ...] = ()
    depth: int | None = None
    adaptive: bool = True
    logits: LogitsSettings = NO_PROCESSING
    logprobs: int | None = None
    oracle: Oracle | None = None

    @property
    def needs_history(self) -> bool:
        """Whether each round needs the tokens before it (processors or log-probabilities):
        one stream decodes it, never looking a round ahead."""
        return self.logits.processes or self.logprobs is not None

    @property
    def one_stream(self) -> bool:
        """Whether only the one-stream decoder honours it (a batch does not yet)."""
        return self.needs_history or self.logits.plain_only(self.sampling.temp)


@dataclass
class TokenEvent:
    """One confirmed token: its id, the text it completes (may be empty: held back for a
    multi-byte character or a possible stop string), whether it was a kept draft, and on
    the last event why decoding ended (`stop`, `length`, `cancelled`)."""

    token: int | None
    text: str
    from_draft: bool = False
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None  # with `Request.logprobs`


class Engine:
    """A target loaded once with its drafter and prompt cache (see the module's text).
    `mtp`: True drafts (the head, or `drafter`'s choice; True without a head is an error),
    "auto" drafts when there is something to draft with, False decodes plainly."""

    def __init__(
        self,
        m: MtpModel,
        *,
        drafter: DrafterChoice = HEAD,
        mtp: bool | str = True,
        prompt_cache_size: int = DEFAULT_SIZE,
        max_kv_size: int | None = None,
        pipeline: bool | str | None = None,
    ) -> None:
        _check_count("prompt_cache_size", prompt_cache_size, 0)
        if max_kv_size is not None:
            _check_count("max_kv_size", max_kv_size, 1)
        self.m = m
        self.max_kv_size = max_kv_size
        self.pipeline = pipeline
        self.owner: threading.Thread | None = None  # the thread that decodes (`session`)
        self.drafts = bool(mtp) and (not drafter.uses_head or m.has_head)
        if mtp is True and not self.drafts:
            raise NoMtpHead(f"{m.path} has no MTP head")
        self.proposers = ProposerFactory(m, drafter) if self.drafts else None
        self.prompt_cache = PromptCache(prompt_cache_size)
        self.prefill_step_size = 2048  # tokens per prefill forward (mlx-lm's default)
        # Adaptive drafting's last clear losing verdict, which the next greedy request goes on
        # from (`speculative/adaptive.py`), by the depths it chooses from and whether logits
        # processors judge the drafts (a strong bias can make every draft lose).
        self.drafting_memory: dict[tuple[int, bool, bool], DraftingMemory] = {}

    @classmethod
    def load(
        cls,
        model: str | Path,
        *,
        drafter: DrafterChoice = HEAD,
        mtp: bool | str = True,
        hidden: str | None = None,
        adapter_path: str | Path | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load a model directory (or Hub repo) and its drafter; `adapter_path`: LoRA
        adapters applied to the model, as `mlx_lm.load` applies them."""
        with_head = bool(mtp) and drafter.uses_head
        m = load_model(model, hidden=hidden, with_head=with_head, adapter_path=adapter_path)
        return cls(m, drafter=drafter, mtp=mtp, **kwargs)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (mlx-lm's `TokenizerWrapper`, as `mlx_lm.load` returns it):
        `engine.tokenizer.encode(text)` gives the token ids a `Request` takes."""
        return self.m.tokenizer

    @property
    def drafter_name(self) -> str:
        return self.proposers.name if self.proposers is not None else "none"

    def session(self, request: Request) -> Session:
        """A session on this engine, on the thread that made the engine's first one: the
        model carries process-wide state while it decodes, and MLX's streams belong to a
        thread, so two threads decoding on one engine would corrupt each other."""
        current = threading.current_thread()
        if self.owner is None:
            self.owner = current
        elif self.owner is not current:
            raise EngineThreadError(
                f"this Engine decodes on thread {self.owner.name!r}, not {current.name!r}: "
                "decode each engine on one thread (hand requests to it through a queue, as "
                "`mtpkit serve` does), or load one engine per thread"
            )
        return Session(self, request)

    def stream(self, request: Request) -> Iterator[TokenEvent]:
        return iter(self.session(request))


class Session:
    """One request on an engine (see the module's text): iterate it for `TokenEvent`s;
    `stats` and `text` after."""

    def __init__(self, engine: Engine, request: Request) -> None:
        m = engine.m
        check_prompt(m, request.prompt)
        depth, choose = resolve_depth(request.depth, request.adaptive)
        require_depth(depth)
        if request.max_tokens < 0:
            raise GenerateError(f"max_tokens must be at least 0, not {request.max_tokens}")
        self.engine, self.request = engine, request
        check_seed(request.seed)
        if request.seed is not None:
            mx.random.seed(request.seed)
        name = engine.drafter_name
        hit = engine.prompt_cache.longest_prefix(request.prompt, name)
        cache, proposer, cached = None, None, 0
        if hit is not None:
            cache, proposer = hit.fork()
            cached = len(hit.tokens) - 1
        elif engine.proposers is not None:
            proposer = engine.proposers()
        plain = request.logits.plain_only(request.sampling.temp)
        if request.oracle is not None:
            check_oracle(request, drafts=proposer is not None and not plain)
            plan = request.oracle.plan(len(request.prompt), int(m.embedding.weight.shape[0]))
            proposer = plan.proposer(proposer)
        self.decoder = MtpDecoder(
            m, request.prompt, depth=depth, sampling=request.sampling, adaptive=request.adaptive,
            use_mtp=engine.drafts and not plain, max_kv_size=engine.max_kv_size,
            pipeline=False if request.needs_history else engine.pipeline,
            choose_depth=choose, proposer=proposer, cache=cache, cached=cached,
            memory=engine.drafting_memory.setdefault(
                (depth, choose, request.logits.processes), DraftingMemory()
            ),
        )  # fmt: skip
        self.decoder.prefill_step_size = engine.prefill_step_size
        self.decoder.processors = request.logits.processors()
        self.decoder.logprobs_top = request.logprobs
        if plain:
            self.decoder.sampler = request.logits.xtc_sampler(request.sampling, m.tokenizer)
        self.text_stream = TextStream(m.tokenizer, request.stop)
        self.finish_reason: str | None = None
        self.cancelled = False

    @property
    def stats(self) -> Stats:
        return self.decoder.stats

    @property
    def text(self) -> str:
        return self.text_stream.text

    def cancel(self) -> None:
        """End decoding before the next step (a client went away)."""
        self.cancelled = True

    def __iter__(self) -> Iterator[TokenEvent]:
        decoder, request = self.decoder, self.request
        decoder.after_prefill = lambda: self._remember(request.prompt, decoder.prefilled_cache)
        events = decoder.events(request.max_tokens)
        produced, last, reason = 0, None, STOP
        try:
            for token, from_draft in events:
                produced += 1
                piece = self.text_stream.add(token)
                if last is not None:
                    yield last
                last = TokenEvent(token, piece, from_draft)
                if request.logprobs is not None:
                    last.logprob = decoder.logprobs[produced - 1]
                if self.text_stream.stopped:
                    break
                if self.cancelled:
                    reason = CANCELLED
                    break
                if produced == 1 < request.max_tokens:  # the first token goes out at once
                    yield last
                    last = None
            else:
                reason = LENGTH if produced >= request.max_tokens else STOP
        finally:
            events.close()
        self.finish_reason = reason
        tail = self.text_stream.finish() if reason != CANCELLED else ""
        if reason != CANCELLED:  # a generation its first token ended: its prompt's state
            decoder.finish_prefill()
        if decoder.clean and decoder.confirmed:
            self._remember(request.prompt + decoder.confirmed, decoder.cache)
        last = last or TokenEvent(None, "")
        last.text += tail
        last.finish_reason = reason
        yield last

    def _remember(self, tokens: list[int], cache: list[Any]) -> None:
        engine, decoder = self.engine, self.decoder
        engine.prompt_cache.store(tokens, cache, decoder.proposer, engine.drafter_name)


# -- the Python API, as mlx-lm's `load`, `generate`, `stream_generate` --------------------


def load(
    model: str | Path,
    *,
    draft_model: str | Path | None = None,
    prompt_lookup: bool = False,
    mtp: bool | str = "auto",
    prompt_cache_size: int = DEFAULT_SIZE,
    max_kv_size: int | None = None,
    adapter_path: str | Path | None = None,
) -> Engine:
    """A model directory (or Hub repo) loaded once, ready to decode requests: drafting with
    its MTP head where it has one (`mtp` "auto"; True requires one, False decodes plainly), or
    with `draft_model` / `prompt_lookup`; `adapter_path` as mlx-lm's."""
    drafter = DrafterChoice(draft_model=draft_model, prompt_lookup=prompt_lookup)
    return Engine.load(
        model, drafter=drafter, mtp=mtp, prompt_cache_size=prompt_cache_size,
        max_kv_size=max_kv_size, adapter_path=adapter_path,
    )  # fmt: skip


def make_request(
    engine: Engine,
    prompt: str | list[int] | list[dict[str, Any]],
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = TOP_P_OFF,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    depth: int | None = None,
    chat_template: bool = False,
    sampler: SamplingSettings | None = None,
) -> Request:
    """The `Request` that decodes `prompt`. As mlx-lm's `stream_generate`,
    text is the model's input as it stands (`chat_template=True` puts it through the chat
    template as one user message) and token ids are used as given; chat messages (a list of
    `{"role", "content"}` dicts) always go through the template. `sampler` is a
    `SamplingSettings` in place of `temp`/`top_p`/`top_k`/`min_p` (mlx-lm's sampler is a
    function, which rejection sampling cannot judge a draft with)."""
    if isinstance(prompt, str):
        tokens = encode_prompt(engine.tokenizer, prompt, chat_template=chat_template)
    elif prompt and isinstance(prompt[0], dict):
        tokens = encode_messages(engine.tokenizer, prompt)  # type: ignore[arg-type]
    elif isinstance(prompt, list | tuple):
        tokens = list(prompt)
    else:
        raise GenerateError(
            f"the prompt must be text, token ids or chat messages, not {type(prompt).__name__}"
        )
    check_prompt(engine.m, tokens)
    check_seed(seed)
    if sampler is None:
        sampler = SamplingSettings.checked(
            temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, vocab_size=engine.m.vocab_size
        )
    elif not isinstance(sampler, SamplingSettings):
        raise GenerateError(
            "sampler= takes an mtpkit.SamplingSettings (an mlx-lm sampler is a function, which "
            "rejection sampling cannot judge a draft with): pass temp=, top_p=, top_k=, min_p="
        )
    else:
        sampler = SamplingSettings.checked(
            **{f: getattr(sampler, f) for f in ("temp", "top_p", "top_k", "min_p")},
            min_tokens_to_keep=sampler.min_tokens_to_keep, vocab_size=engine.m.vocab_size,
        )  # fmt: skip
    return Request(tokens, max_tokens, sampler, seed, tuple(stop), depth)


def stream_generate(engine: Engine, prompt: Any, **kwargs: Any) -> Iterator[TokenEvent]:
    """Decode `prompt` and yield a `TokenEvent` per token (the arguments as `make_request`'s:
    `max_tokens`, `temp`, `top_p`, `top_k`, `min_p`, `seed`, `stop`, `depth`,
    `chat_template`, `sampler`)."""
    return engine.stream(make_request(engine, prompt, **kwargs))


def generate(
    engine: Engine,
    prompt: str | list[int] | list[dict[str, Any]],
    *,
    verbose: bool = False,
    **kwargs: Any,
) -> str:
    """The text `stream_generate` decodes (same arguments). `verbose`, as mlx-lm's: the text
    as it streams between `==========` lines, then the `Prompt:`, `Generation:` and
    `Peak memory:` lines, and mtpkit's `MTP:` line (acceptance)."""
    session = engine.session(make_request(engine, prompt, **kwargs))
    if verbose:
        print("=" * 10)
    pieces = []
    for event in session:
        pieces.append(event.text)
        if verbose:
            print(event.text, end="", flush=True)
    text = "".join(pieces)
    if verbose:
        print_summary(session, text)
    return text


def print_summary(session: Session, text: str) -> None:
    """mlx-lm's closing lines for `generate(..., verbose=True)`, and an `MTP:` line."""
    stats = session.stats
    print()
    print("=" * 10)
    if not text:
        print("No text generated for this prompt")
        return
    prompt_tps = stats.prompt_tokens / stats.prompt_time if stats.prompt_time else 0.0
    decode_tps = stats.decode_tokens / stats.decode_time if stats.decode_time else 0.0
    # mlx-lm counts the EOS that ended generation among the generated tokens.
    at_eos = session.finish_reason == STOP and not session.text_stream.stopped
    print(f"Prompt: {stats.prompt_tokens} tokens, {prompt_tps:.3f} tokens-per-sec")
    print(f"Generation: {len(stats.generated) + at_eos} tokens, {decode_tps:.3f} tokens-per-sec")
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    if stats.proposer == "none":
        print("MTP: off (plain decoding)")
        return
    acceptance = "n/a" if stats.acceptance is None else f"{stats.acceptance:.1%}"
    print(f"MTP: {stats.proposer}, acceptance {acceptance} ({stats.accepted}/{stats.drafted})")
