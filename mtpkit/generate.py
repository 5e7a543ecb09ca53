"""`mtpkit generate`: lossless speculative decoding with a checkpoint's own MTP head.

Each round the head drafts K tokens (chaining itself K times), the backbone verifies
`[last confirmed token, draft_1..draft_K]` in one forward pass, and the longest prefix the
backbone agrees with is kept, plus the backbone's own next token. Greedy decoding keeps a
draft iff it equals the backbone's argmax, so the output is the backbone's greedy output;
at a temperature, exact rejection sampling keeps the output distribution the backbone's.

Caches after a partial acceptance: KV caches are trimmed; the gated-delta-net layers of
Qwen3.5/3.6/Next, whose recurrent and conv states cannot be trimmed, keep per-token
snapshots taken inside the verify pass, so a rejection never costs another forward pass.

The backbone is stock mlx-lm's model; the only change is a tap on its final norm that keeps
the last hidden state (its input for `pre_norm`, its output for `post_norm`).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.errors import MtpkitError
from mtpkit.heads import HeadWeights, MtpHead, load_head

POST_NORM = "post_norm"
PRE_NORM = "pre_norm"
HIDDEN_MODES = (POST_NORM, PRE_NORM)
MAX_DEPTH = 4


class NoMtpHead(MtpkitError):
    """`--mtp` was asked of a model without a usable MTP head."""


class PromptTooLong(MtpkitError):
    """The prompt does not fit the model's context."""


class GenerateError(MtpkitError):
    """Bad generate options."""


# ---------------------------------------------------------------------------------------
# Taps on the stock backbone.


class HiddenCapture:
    """The input and output of the backbone's final norm in the last forward pass."""

    def __init__(self) -> None:
        self.pre: mx.array | None = None
        self.post: mx.array | None = None


def tap_final_norm(norm: nn.Module) -> HiddenCapture:
    """Make `norm` record its input and output, keeping its class, weights and result.

    The instance gets a subclass of its own class (parameter paths and quantization are
    unchanged, unlike a wrapper module). Tapping twice returns the first tap's capture, so
    every user of a shared backbone reads the same one.
    """
    base = type(norm)
    if getattr(base, "_mtpkit_tap", False):
        return norm._mtpkit_capture

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        out = base.__call__(self, x)
        self._mtpkit_capture.pre = x
        self._mtpkit_capture.post = out
        return out

    norm.__class__ = type(
        f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtpkit_tap": True}
    )
    norm._mtpkit_capture = HiddenCapture()
    return norm._mtpkit_capture


@contextlib.contextmanager
def untapped(norm: nn.Module) -> Iterator[None]:
    """The final norm as stock mlx-lm has it, for plain decoding (no hidden state kept)."""
    cls = type(norm)
    if not getattr(cls, "_mtpkit_tap", False):
        yield
        return
    norm.__class__ = cls.__mro__[1]
    try:
        yield
    finally:
        norm.__class__ = cls


@dataclass
class GdnSnapshots:
    """Per-token states of every gated-delta-net layer during one verify pass."""

    conv_inputs: list[mx.array] = field(default_factory=list)
    states: list[list[mx.array]] = field(default_factory=list)


_ACTIVE_SNAPSHOTS: contextvars.ContextVar[GdnSnapshots | None] = contextvars.ContextVar(
    "mtpkit_gdn_snapshots", default=None
)
_PATCHED_MODULES: set[str] = set()


def _stepwise_gated_delta_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap mlx-lm's `gated_delta_update` so that, inside a verify pass, it runs the
    recurrence one token at a time (the same sequential recurrence mlx-lm runs) and keeps
    the state after each token. Outside a verify pass it is the original function."""

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):  # noqa: N803
        snapshots = _ACTIVE_SNAPSHOTS.get()
        if snapshots is None or q.shape[1] == 1:
            out = original(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
            if snapshots is not None:
                snapshots.states.append([out[1]])
            return out
        ys, states = [], []
        for t in range(q.shape[1]):
            y, state = original(
                q[:, t : t + 1],
                k[:, t : t + 1],
                v[:, t : t + 1],
                a[:, t : t + 1],
                b[:, t : t + 1],
                A_log,
                dt_bias,
                state,
                None if mask is None else mask[:, t : t + 1],
                **kwargs,
            )
            ys.append(y)
            states.append(state)
        snapshots.states.append(states)
        return mx.concatenate(ys, axis=1), state

    update._mtpkit_original = original  # type: ignore[attr-defined]
    return update


def _patch_gated_delta(module_name: str) -> None:
    import importlib

    if module_name in _PATCHED_MODULES:
        return
    module = importlib.import_module(module_name)
    if hasattr(module, "gated_delta_update"):
        module.gated_delta_update = _stepwise_gated_delta_update(module.gated_delta_update)
    _PATCHED_MODULES.add(module_name)


def tap_conv_input(conv: nn.Module) -> None:
    """Make a gated-delta-net's conv1d record its input (the conv state plus new tokens)."""
    base = type(conv)
    if getattr(base, "_mtpkit_tap", False):
        return

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        snapshots = _ACTIVE_SNAPSHOTS.get()
        if snapshots is not None:
            snapshots.conv_inputs.append(x)
        return base.__call__(self, x)

    conv.__class__ = type(
        f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtpkit_tap": True}
    )


# ---------------------------------------------------------------------------------------
# The model: stock backbone + head.


@dataclass
class MtpModel:
    """A loaded model directory: mlx-lm's backbone, its tokenizer, and the MTP head if any."""

    path: Path
    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]
    head: MtpHead | None
    head_weights: HeadWeights | None
    hidden: str
    capture: HiddenCapture
    context_length: int | None

    @property
    def text_model(self) -> nn.Module:
        return getattr(self.model, "language_model", self.model)

    @property
    def inner(self) -> nn.Module:
        return self.model.model

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def lm_head(self, x: mx.array) -> mx.array:
        if "lm_head" in self.text_model:
            return self.text_model.lm_head(x)
        return self.inner.embed_tokens.as_linear(x)

    def hidden_state(self) -> mx.array:
        return self.capture.post if self.hidden == POST_NORM else self.capture.pre

    def make_cache(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)


def resolve_model_path(spec: str, revision: str | None = None) -> Path:
    path = Path(spec)
    if path.exists():
        if not (path / "config.json").exists():
            raise MtpkitError(f"{spec} has no config.json: pass a model directory")
        return path
    if spec.count("/") != 1 or spec.startswith((".", "/")):
        raise MtpkitError(f"{spec}: no such directory (and not a Hub repo id)")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                spec,
                revision=revision,
                allow_patterns=[
                    "*.json",
                    "*.safetensors",
                    "*.py",
                    "*.model",
                    "*.tiktoken",
                    "*.txt",
                    "*.jinja",
                ],
            )
        )
    except Exception as e:  # noqa: BLE001 - the hub client raises many kinds
        raise MtpkitError(f"could not fetch {spec} from the Hub: {e}") from None


_BACKBONES: dict[tuple[str, float], tuple[nn.Module, Any, dict[str, Any]]] = {}


def _backbone_key(path: Path) -> tuple[str, float] | None:
    """The last loaded backbone is reused while its files are unchanged."""
    try:
        stamps = [p.stat().st_mtime for p in path.glob("*.safetensors")]
        stamps.append((path / "config.json").stat().st_mtime)
    except OSError:
        return None
    return str(path.resolve()), max(stamps)


def _load_backbone_beside_head(path: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Stock mlx-lm's model when head tensors sit in a `model*.safetensors` file that its
    loader reads (vllm-mlx's Qwen3-Next `model-mtp.safetensors`) and its sanitize keeps
    (Qwen3-Next's, for converted checkpoints): the family's own class, whose sanitize first
    drops the head's tensors, still loaded strictly."""
    import inspect

    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    stock_classes = inspect.signature(mlx_load_model).parameters["get_model_classes"].default

    def classes(config: dict[str, Any]) -> tuple[type[nn.Module], type]:
        model_cls, args_cls = stock_classes(config)

        class WithoutHead(model_cls):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                weights = {k: v for k, v in weights.items() if not _is_head_key(k)}
                return super().sanitize(weights) if hasattr(model_cls, "sanitize") else weights

        return WithoutHead, args_cls

    try:
        model, config = mlx_load_model(path, get_model_classes=classes)
    except ValueError as e:
        raise MtpkitError(f"mlx-lm cannot load {path}: {e}") from None
    return model, load_tokenizer(path), config


def _is_head_key(name: str) -> bool:
    return name.startswith(("mtp.", "model.mtp.", "language_model.mtp.", "model.mtp_layers."))


def load_model(
    spec: str | Path,
    *,
    hidden: str | None = None,
    concat_order: str | None = None,
    norm_shift: float = 0.0,
    with_head: bool = True,
    revision: str | None = None,
) -> MtpModel:
    """Load a model directory with stock mlx-lm and attach its MTP head (if it has one)."""
    import mlx_lm

    path = resolve_model_path(str(spec), revision)
    key = _backbone_key(path)
    if key is not None and key in _BACKBONES:
        model, tokenizer, config = _BACKBONES[key]
    else:
        try:
            model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
        except ValueError as e:
            if "mtp" not in str(e):
                raise MtpkitError(f"mlx-lm cannot load {path}: {e}") from None
            model, tokenizer, config = _load_backbone_beside_head(path)
        if key is not None:
            _BACKBONES.clear()  # keep one: a check measures one model many times
            _BACKBONES[key] = (model, tokenizer, config)
    head = head_weights = None
    manifest = None
    if with_head:
        loaded = load_head(path, config, norm_shift=norm_shift, concat_order=concat_order)
        if loaded is not None:
            head, head_weights = loaded
            manifest = head_weights.manifest
    if hidden is None:
        hidden = (manifest or {}).get("hidden") or POST_NORM
    if hidden not in HIDDEN_MODES:
        raise GenerateError(f"--hidden must be one of {', '.join(HIDDEN_MODES)}, not {hidden!r}")
    capture = tap_final_norm(model.model.norm)
    for layer in getattr(model, "layers", []):
        gdn = layer.get("linear_attn") if isinstance(layer, dict) else None
        if gdn is not None:
            _patch_gated_delta(type(gdn).__module__)
            tap_conv_input(gdn.conv1d)
    text = config.get("text_config") or config
    context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    return MtpModel(path, model, tokenizer, config, head, head_weights, hidden, capture, context)


# ---------------------------------------------------------------------------------------
# Sampling.


@dataclass(frozen=True)
class SamplingSettings:
    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def sampler(self) -> Callable[[mx.array], mx.array]:
        from mlx_lm.sample_utils import make_sampler

        return make_sampler(temp=self.temp, top_p=self.top_p, top_k=self.top_k)

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution mlx-lm's sampler draws from, for each row of `logits`."""
        from mlx_lm.sample_utils import apply_top_k, apply_top_p

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs.astype(mx.float32) * (1 / self.temp), axis=-1)


def rejection_sample(target: mx.array, draft: mx.array, drafts: list[int]) -> tuple[int, int]:
    """Exact speculative sampling: how many drafts to keep, and the token that follows.

    `target` [K+1, V] are the backbone's distributions after each verify input, `draft`
    [K, V] the head's distributions each draft was drawn from. Draft j is kept with
    probability min(1, p_j(d)/q_j(d)); on the first rejection the next token is drawn from
    normalize(max(p_j - q_j, 0)); when all are kept, from p_K. (Leviathan et al., 2023.)
    """
    for j, d in enumerate(drafts):
        p, q = target[j, d].item(), draft[j, d].item()
        u = mx.random.uniform().item()
        if q > 0 and u < min(1.0, p / q):
            continue
        residual = mx.maximum(target[j] - draft[j], 0.0)
        if residual.sum().item() <= 0:
            residual = target[j]
        token = mx.random.categorical(mx.log(residual)).item()
        return j, int(token)
    return len(drafts), int(mx.random.categorical(mx.log(target[len(drafts)])).item())


# ---------------------------------------------------------------------------------------
# The decoding loop.


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    drafted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    # As mlx-lm reports them: the prompt's time runs to the first output (for MTP, the first
    # round), the decode rate counts the tokens after it.
    prompt_time: float = 0.0
    decode_time: float = 0.0
    decode_tokens: int = 0
    rounds: int = 0
    plain_steps: int = 0
    # (position in prompt + output of the first draft, the drafts) for every round.
    draft_log: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def acceptance_by_depth(self, depth: int) -> list[float | None]:
        return [
            (self.accepted_by_depth[i] / self.drafted_by_depth[i])
            if self.drafted_by_depth[i]
            else None
            for i in range(depth)
        ]


class AdaptiveDrafting:
    """Switches drafting off while it loses to plain decoding, and retries later.

    After two drafting rounds, four plain steps are timed for a reference. Then two checks
    on drafting rounds:
    - hopeless: the faster of the last two rounds took longer than the plain steps for all
      the tokens a round can yield (depth + 1), so no acceptance rate could pay for it
      (a verify pass that costs as much as the tokens in it, as on CPUs): off for 256
      tokens, doubling to 4096;
    - losing: over the last 6 rounds, seconds per emitted token exceed plain decoding's:
      off for 32 tokens, doubling to 1024, reset after a long winning run.
    Each retry costs at most a few rounds, a few percent of the plain time at worst.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.window = 6
        self.plain_stretch = 32
        self.hopeless_stretch = 256
        self.mtp_times: list[tuple[float, int]] = []
        self.plain_times: list[float] = []
        self.plain_left = 0
        self.capacity = 2  # tokens a round can yield: depth + 1
        # Plain speed is measured after the first two rounds (so that short generations
        # draft from the start), over four steps.
        self.probing_plain = False

    def want_draft(self) -> bool:
        if not self.enabled:
            return True
        return self.plain_left <= 0 and not self.probing_plain

    def plain_ahead(self) -> int:
        """Plain steps certain to follow the current one (read before recording it)."""
        if not self.enabled:
            return 0
        if self.probing_plain:
            return max(0, 4 - len(self.plain_times) - 1)
        return max(0, self.plain_left - 1)

    def record_plain(self, seconds: float) -> None:
        if not self.enabled:
            return
        self.plain_times = (self.plain_times + [seconds])[-32:]
        self.plain_left -= 1
        if self.probing_plain and len(self.plain_times) >= 4:
            self.probing_plain = False
            self.plain_left = 0
            self._judge()  # the rounds before the probe may already be hopeless

    def _plain_per_token(self) -> float:
        # The first plain step after a drafting stretch carries the head's catch-up.
        plain = sorted(self.plain_times[1:] or self.plain_times)
        return plain[len(plain) // 2]

    def record_round(self, seconds: float, emitted: int, capacity: int) -> None:
        """A drafting round took `seconds` and yielded `emitted` of at most `capacity`."""
        if not self.enabled:
            return
        self.mtp_times.append((seconds, emitted))
        self.capacity = capacity
        if not self.plain_times:
            if len(self.mtp_times) >= 2:
                self.probing_plain = True
            return
        self._judge()

    def _judge(self) -> None:
        capacity = self.capacity
        plain_per_token = self._plain_per_token()
        if len(self.mtp_times) >= 2:
            fastest = min(s for s, _ in self.mtp_times[-2:])
            if fastest > capacity * plain_per_token:
                self.plain_left = self.hopeless_stretch
                self.hopeless_stretch = min(self.hopeless_stretch * 2, 4096)
                self.mtp_times = []
                return
        if len(self.mtp_times) < self.window:
            return
        recent = self.mtp_times[-self.window :]
        mtp_per_token = sum(s for s, _ in recent) / sum(n for _, n in recent)
        if mtp_per_token > plain_per_token:
            self.plain_left = self.plain_stretch
            self.plain_stretch = min(self.plain_stretch * 2, 1024)
            self.mtp_times = []
        elif len(self.mtp_times) >= 4 * self.window:
            self.plain_stretch = 32
            self.mtp_times = self.mtp_times[-self.window :]


class MtpDecoder:
    """One generation: prefill, then drafting rounds and plain steps until done."""

    def __init__(
        self,
        m: MtpModel,
        prompt: list[int],
        *,
        depth: int,
        sampling: SamplingSettings,
        adaptive: bool,
        use_mtp: bool = True,
    ) -> None:
        if m.head is None and use_mtp:
            raise NoMtpHead(f"{m.path} has no MTP head")
        self.m = m
        self.prompt = prompt
        self.depth = depth
        self.sampling = sampling
        self.use_mtp = use_mtp
        self.adaptive = AdaptiveDrafting(adaptive and use_mtp)
        self.cache = m.make_cache()
        self.head_cache = m.head.make_cache() if m.head is not None else None
        self.linear_caches = [c for c in self.cache if _is_gdn_cache(c)]
        # Pairs (h_k, t_{k+1}) the head has not seen yet; the last token is the last
        # confirmed one, which the backbone has not consumed yet either.
        self.pending_hidden: list[mx.array] = []
        self.pending_tokens: list[int] = []
        self.last_token = prompt[-1]
        self._ahead: tuple[mx.array, mx.array] | None = None
        self.n_confirmed = 0  # tokens confirmed after the prompt
        self.stats = Stats(prompt_tokens=len(prompt))
        self.sampler = sampling.sampler()

    # -- backbone calls ------------------------------------------------------------------
    def _forward(self, tokens: list[int]) -> tuple[mx.array, mx.array]:
        logits = self.m.model(mx.array(tokens)[None], cache=self.cache)
        return logits, self.m.hidden_state()

    def prefill(self, step_size: int = 2048) -> None:
        from mlx_lm.generate import generation_stream

        start = time.perf_counter()
        prompt = self.prompt
        with mx.stream(generation_stream):
            # Like mlx-lm's generate_step: all but the last prompt token, in chunks; the
            # last one is the first input of the decoding loop.
            for i in range(0, len(prompt) - 1, step_size):
                chunk = prompt[i : min(i + step_size, len(prompt) - 1)]
                _, hidden = self._forward(chunk)
                mx.eval([c.state for c in self.cache], hidden)
                self.pending_hidden.append(hidden)
                self.pending_tokens.extend(prompt[i + 1 : i + 1 + len(chunk)])
            if self.m.head is not None and len(self.pending_tokens) > 1:
                # Fill the head's KV cache over the prompt, keeping the last pair to draft.
                self._head_catch_up(keep_last=True)
        self.last_token = prompt[-1]
        self.stats.prompt_time = time.perf_counter() - start

    def _pending(self) -> tuple[mx.array, list[int]]:
        hidden = mx.concatenate(self.pending_hidden, axis=1)
        return hidden, self.pending_tokens

    def _head_catch_up(self, keep_last: bool) -> None:
        hidden, tokens = self._pending()
        n = len(tokens) - (1 if keep_last else 0)
        for i in range(0, n, 2048):
            j = min(i + 2048, n)
            x = self.m.head(
                hidden[:, i:j], self.m.embed(mx.array(tokens[i:j])[None]), self.head_cache
            )
            mx.eval(x, [c.state for c in self.head_cache])
        self.pending_hidden = [hidden[:, n:]]
        self.pending_tokens = tokens[n:]

    # -- drafting ------------------------------------------------------------------------
    def _draft(self) -> tuple[mx.array, mx.array | None]:
        """K draft tokens (lazy, [K] int32) and, when sampling, the distributions [K, V]."""
        head, m = self.m.head, self.m
        hidden, tokens = self._pending()
        x = head(hidden, m.embed(mx.array(tokens)[None]), self.head_cache, step=0)[:, -1:]
        drafts: list[mx.array] = []
        dists = []
        normed = None
        for k in range(self.depth):
            if k > 0:
                prev = normed if m.hidden == POST_NORM else x
                x = head(prev, m.embed(drafts[-1].reshape(1, 1)), self.head_cache, step=k)
            normed = head.final_norm(head.layer_for_step(k))(x)
            logits = m.lm_head(normed)[0, -1]
            if self.sampling.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                q = self.sampling.probs(logits)
                token = mx.random.categorical(mx.log(q))
                dists.append(q)
            drafts.append(token.astype(mx.int32).reshape(1))
        return mx.concatenate(drafts), (mx.stack(dists) if dists else None)

    def _trim_head_drafts(self, k: int) -> None:
        """Drop the head-cache entries built on drafts (steps 1..k-1); the pairs the
        backbone confirms are fed to the head next round."""
        per_layer = [0] * len(self.head_cache)
        for step in range(1, k):
            per_layer[self.m.head.layer_for_step(step)] += 1
        for cache, n in zip(self.head_cache, per_layer, strict=True):
            if n:
                cache.trim(n)

    def _restore_gdn(self, snapshots: GdnSnapshots, kept: int, total: int) -> None:
        if kept == total:
            return
        for cache, conv_input, states in zip(
            self.linear_caches, snapshots.conv_inputs, snapshots.states, strict=True
        ):
            n_keep = cache[0].shape[1]
            cache[0] = mx.contiguous(conv_input[:, kept : kept + n_keep, :])
            cache[1] = states[kept - 1]

    def draft_round(self) -> list[int]:
        """One drafting round; returns the tokens it confirms (at least one)."""
        drafts_arr, draft_dists = self._draft()
        k = self.depth
        verify = mx.concatenate([mx.array([self.last_token], dtype=mx.int32), drafts_arr])
        snapshots = GdnSnapshots()
        token_ctx = _ACTIVE_SNAPSHOTS.set(snapshots if self.linear_caches else None)
        try:
            logits = self.m.model(verify[None], cache=self.cache)
            hidden = self.m.hidden_state()
        finally:
            _ACTIVE_SNAPSHOTS.reset(token_ctx)
        logits = logits[0]
        if self.sampling.greedy:
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets_arr = mx.argmax(logprobs, axis=-1)
            mx.eval(targets_arr, drafts_arr)
            drafts, targets = drafts_arr.tolist(), targets_arr.tolist()
            accepted = 0
            while accepted < k and drafts[accepted] == targets[accepted]:
                accepted += 1
            next_token = targets[accepted]
        else:
            target = self.sampling.probs(logits)
            mx.eval(target, drafts_arr, draft_dists)
            drafts = drafts_arr.tolist()
            accepted, next_token = rejection_sample(target, draft_dists, drafts)
        self._trim_head_drafts(k)
        kept = accepted + 1  # verify inputs whose effect on the caches stays
        if kept < k + 1:
            for c in self.cache:
                if not _is_gdn_cache(c):
                    c.trim(k + 1 - kept)
            self._restore_gdn(snapshots, kept, k + 1)
        confirmed = drafts[:accepted] + [next_token]
        self.stats.draft_log.append((len(self.prompt) + self.n_confirmed, drafts))
        self.n_confirmed += len(confirmed)
        self.pending_hidden = [hidden[:, :kept]]
        self.pending_tokens = confirmed
        self.last_token = next_token
        self.stats.drafted += k
        self.stats.accepted += accepted
        for j in range(min(accepted + 1, k)):
            self.stats.drafted_by_depth[j] += 1
            self.stats.accepted_by_depth[j] += 1 if j < accepted else 0
        self.stats.rounds += 1
        return confirmed

    def _plain_forward(self, token: mx.array) -> tuple[mx.array, mx.array]:
        logits = self.m.model(token.reshape(1, 1), cache=self.cache)
        hidden = self.m.hidden_state()
        logits = logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return self.sampler(logprobs), hidden

    def plain_step(self, ahead: bool = False) -> list[int]:
        """One backbone step, as mlx-lm's generate_step takes it. With `ahead` (the next
        step is certain to be plain too) the next forward is queued before this token is
        read, so the two overlap as in mlx-lm's own loop."""
        if self._ahead is not None:
            y, hidden = self._ahead
            self._ahead = None
        else:
            y, hidden = self._plain_forward(mx.array([self.last_token]))
        if ahead:
            self._ahead = self._plain_forward(y)
            mx.async_eval(*self._ahead)
        token = int(y.item())
        self.pending_hidden.append(hidden)
        self.pending_tokens.append(token)
        self.last_token = token
        self.n_confirmed += 1
        if self.m.head is not None and len(self.pending_tokens) > 256:
            self._head_catch_up(keep_last=True)
        self.stats.plain_steps += 1
        return [token]

    # -- the loop ------------------------------------------------------------------------
    def tokens(self, max_tokens: int) -> Iterator[int]:
        from mlx_lm.generate import generation_stream

        eos = set(getattr(self.m.tokenizer, "eos_token_ids", None) or [])
        start = time.perf_counter()
        self.prefill()
        produced = 0
        first_done: float | None = None
        first_count = 0
        try:
            with mx.stream(generation_stream):
                while produced < max_tokens:
                    t0 = time.perf_counter()
                    can_draft = self.use_mtp and self.m.head is not None
                    drafting = can_draft and self.adaptive.want_draft() and self._ahead is None
                    if drafting and self.pending_tokens:
                        new = self.draft_round()
                        self.adaptive.record_round(
                            time.perf_counter() - t0, len(new), self.depth + 1
                        )
                    else:
                        ahead = not can_draft or self.adaptive.plain_ahead() > 0
                        new = self.plain_step(ahead=ahead and produced + 1 < max_tokens)
                        self.adaptive.record_plain(time.perf_counter() - t0)
                    if first_done is None:
                        first_done = time.perf_counter()
                        first_count = len(new)
                        self.stats.prompt_time = first_done - start
                    for t in new:
                        if t in eos:
                            return
                        self.stats.generated.append(t)
                        produced += 1
                        yield t
                        if produced >= max_tokens:
                            break
        finally:
            if first_done is not None:
                self.stats.decode_time = time.perf_counter() - first_done
                self.stats.decode_tokens = max(0, len(self.stats.generated) - first_count)


def _is_gdn_cache(cache: Any) -> bool:
    from mlx_lm.models.cache import ArraysCache

    return isinstance(cache, ArraysCache)


# ---------------------------------------------------------------------------------------
# Public API.


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    prompt_tokens: int
    drafted: int
    accepted: int
    acceptance_by_depth: list[float | None]
    decode_tps: float
    prompt_tps: float
    peak_memory_gb: float
    mtp: bool
    depth: int

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
        }


def encode_prompt(m: MtpModel, prompt: str, *, chat_template: bool = True) -> list[int]:
    tokenizer = m.tokenizer
    if chat_template and getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
        )
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))


def check_prompt(m: MtpModel, prompt: list[int]) -> None:
    if not prompt:
        raise GenerateError("the prompt is empty")
    if m.context_length and len(prompt) >= int(m.context_length):
        raise PromptTooLong(
            f"the prompt has {len(prompt)} tokens but {m.path.name} has a context of "
            f"{m.context_length}: shorten the prompt"
        )


def stream_tokens(
    m: MtpModel,
    prompt: list[int],
    *,
    max_tokens: int = 256,
    mtp: bool = True,
    depth: int = 1,
    sampling: SamplingSettings = SamplingSettings(),
    adaptive: bool = True,
    seed: int | None = None,
) -> tuple[Iterator[int], Callable[[], Stats]]:
    """Token ids as they are confirmed, and a function giving the run's statistics."""
    if not 1 <= depth <= MAX_DEPTH:
        raise GenerateError(f"--depth must be between 1 and {MAX_DEPTH}, not {depth}")
    check_prompt(m, prompt)
    if seed is not None:
        mx.random.seed(seed)
    if not mtp:
        return _stock_tokens(m, prompt, max_tokens=max_tokens, sampling=sampling)
    decoder = MtpDecoder(m, prompt, depth=depth, sampling=sampling, adaptive=adaptive)
    return decoder.tokens(max_tokens), lambda: decoder.stats


def _stock_tokens(
    m: MtpModel, prompt: list[int], *, max_tokens: int, sampling: SamplingSettings
) -> tuple[Iterator[int], Callable[[], Stats]]:
    """Plain decoding is stock mlx-lm's `stream_generate`, unchanged."""
    from mlx_lm import stream_generate

    stats = Stats(prompt_tokens=len(prompt))

    def run() -> Iterator[int]:
        start = time.perf_counter()
        first = None
        with untapped(m.model.model.norm):
            for response in stream_generate(
                m.model,
                m.tokenizer,
                mx.array(prompt),
                max_tokens=max_tokens,
                sampler=sampling.sampler(),
            ):
                if first is None:
                    first = time.perf_counter()
                    stats.prompt_time = first - start
                if response.finish_reason == "stop":
                    break
                stats.generated.append(response.token)
                yield response.token
        stats.decode_time = time.perf_counter() - (first or start)
        stats.decode_tokens = len(stats.generated)

    return run(), lambda: stats


def generate(
    model: str | Path | MtpModel,
    prompt: str | list[int],
    *,
    max_tokens: int = 256,
    mtp: bool | str = True,
    depth: int = 1,
    temp: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    hidden: str | None = None,
    adaptive: bool = True,
    chat_template: bool = True,
    on_token: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generate from a model directory with (or without) its MTP head.

    `mtp` is True (the head is required), False, or "auto" (use the head when there is one,
    else warn and decode plainly). `on_token` receives text segments as they are decoded.
    """
    if isinstance(model, MtpModel):
        m = model
    else:
        m = load_model(model, hidden=hidden, with_head=mtp is not False)
    use_mtp = bool(mtp)
    if use_mtp and m.head is None:
        message = (
            f"{m.path} has no MTP head (no mtp/weights.safetensors sidecar and no mtp.* "
            "tensors in its shards): run `mtpkit inspect` on it, and `mtpkit convert` the "
            "original checkpoint to keep its head"
        )
        if mtp == "auto":
            (warn or (lambda s: print(f"Warning: {s}", file=sys.stderr)))(
                message + "; decoding without MTP"
            )
            use_mtp = False
        else:
            raise NoMtpHead(message)
    tokens = (
        prompt
        if isinstance(prompt, list)
        else encode_prompt(m, prompt, chat_template=chat_template)
    )
    sampling = SamplingSettings(temp=temp, top_p=top_p, top_k=top_k)
    mx.reset_peak_memory()
    it, stats_fn = stream_tokens(
        m,
        tokens,
        max_tokens=max_tokens,
        mtp=use_mtp,
        depth=depth,
        sampling=sampling,
        adaptive=adaptive,
        seed=seed,
    )
    detokenizer = m.tokenizer.detokenizer
    detokenizer.reset()
    for t in it:
        detokenizer.add_token(t)
        if on_token is not None and (segment := detokenizer.last_segment):
            on_token(segment)
    detokenizer.finalize()
    if on_token is not None and (segment := detokenizer.last_segment):
        on_token(segment)
    stats = stats_fn()
    return GenerationResult(
        text=detokenizer.text,
        tokens=list(stats.generated),
        prompt_tokens=stats.prompt_tokens,
        drafted=stats.drafted,
        accepted=stats.accepted,
        acceptance_by_depth=stats.acceptance_by_depth(depth) if use_mtp else [],
        decode_tps=stats.decode_tokens / stats.decode_time if stats.decode_time > 0 else 0.0,
        prompt_tps=stats.prompt_tokens / stats.prompt_time if stats.prompt_time > 0 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        mtp=use_mtp,
        depth=depth if use_mtp else 0,
    )


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
    if m.head is None:
        raise NoMtpHead(f"{m.path} has no MTP head: run `mtpkit inspect` and `mtpkit convert`")
    drafted = accepted = 0
    for text in prompts:
        tokens = encode_prompt(m, text, chat_template=chat_template)
        check_prompt(m, tokens)
        decoder = MtpDecoder(m, tokens, depth=1, sampling=SamplingSettings(), adaptive=False)
        for _ in decoder.tokens(max_tokens):
            pass
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    return accepted / drafted if drafted else 0.0


__all__ = [
    "GenerationResult",
    "MtpModel",
    "SamplingSettings",
    "generate",
    "load_model",
    "measure_acceptance",
    "rejection_sample",
    "stream_tokens",
]
