"""Which drafts a verify pass accepts, decided on the device: greedy matching and exact
rejection sampling, packed into one small array so that a round reads the host once.

A proposer (`mtpkit.speculative.proposers`) drafts K tokens; the target verifies them in one
pass. The accepted drafts are followed by one token of the backbone's own: the bonus token
when every draft is accepted, else the recovered token that replaces the first rejected one
(greedy: the backbone's argmax there; sampling: a draw from the residual distribution).

`verdict` returns, lazily (this module is the only one that packs or reads the layout):
- `packed` int32: what `read_verdict` turns into a `Verdict` (the number of accepted drafts,
  the bonus or recovered token after them, and the drafts) (greedy: the backbone's argmaxes and the
  drafts; sampling: the count, the token, the drafts);
- `followers` int32 [K+1]: the confirmed token after each verify input (valid up to the
  number kept), which the head pairs with the target's hidden states next round.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.core.choices import TOP_P_OFF
from mtpkit.core.errors import MtpkitError


class BadSampling(MtpkitError):
    """A sampling setting outside what the sampler can draw with."""


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """mlx-lm's filters and categorical draw are compiled with MLX's global random state as
    their input and output (`mx.compile(inputs=mx.random.state, ...)`): while one is traced
    the state holds placeholders, and a trace that raises (mlx-lm's own check of `top_k`,
    say) leaves them there, so every later unseeded draw fails ("Attempting to eval an array
    without a primitive"). Here the state is put back, as a generator seeded from the key it
    held before, when the body raises."""
    saved = list(mx.random.state)
    try:
        yield
    except BaseException:
        high, low = (int(part) for part in saved[0].tolist())
        mx.random.seed((high << 32) | low)
        raise


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadSampling(f"{name} must be a finite number, not {value!r}")
    return float(value)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadSampling(f"{name} must be an integer of 0 or more, not {value!r}")
    return value


@dataclass(frozen=True)
class SamplingSettings:
    temp: float = 0.0
    top_p: float = TOP_P_OFF
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1  # of min-p's filter (mlx_lm.generate --min-tokens-to-keep)

    @classmethod
    def checked(
        cls, *, temp: Any = 0.0, top_p: Any = TOP_P_OFF, top_k: Any = 0, min_p: Any = 0.0,
        min_tokens_to_keep: Any = 1, vocab_size: int | None = None,
    ) -> SamplingSettings:  # fmt: skip
        """The settings, validated once where they are built (the CLI, the Python API and
        the server all build them here): a `BadSampling` naming the first that mlx-lm's
        sampler would reject, misread or crash on. temp >= 0, 0 < top_p <= 1, 0 <= min_p
        <= 1, integers top_k >= 0 and min_tokens_to_keep >= 1; then `fitted` to the model's
        `vocab_size` when it is known."""
        temp, top_p, min_p = _real("temp", temp), _real("top_p", top_p), _real("min_p", min_p)
        if temp < 0:
            raise BadSampling(f"temp must be 0 (greedy) or more, not {temp:g}")
        if not 0 < top_p <= 1:
            raise BadSampling(f"top_p must be above 0 and at most 1, not {top_p:g}")
        if not 0 <= min_p <= 1:
            raise BadSampling(f"min_p must be from 0 to 1, not {min_p:g}")
        top_k = _count("top_k", top_k)
        if _count("min_tokens_to_keep", min_tokens_to_keep) < 1:
            raise BadSampling("min_tokens_to_keep must be 1 or more")
        return cls(temp, top_p, top_k, min_p, min_tokens_to_keep).fitted(vocab_size)

    def fitted(self, vocab_size: int | None) -> SamplingSettings:
        """These settings for a model of `vocab_size` ids: a top_k of that many or more
        keeps every token, which is what 0 means (mlx-lm's filter refuses it)."""
        if vocab_size is not None and self.top_k >= vocab_size:
            return SamplingSettings(self.temp, self.top_p, 0, self.min_p, self.min_tokens_to_keep)
        return self

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def sampler(self) -> Callable[[mx.array], mx.array]:
        from mlx_lm.sample_utils import make_sampler

        sample = make_sampler(
            temp=self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k,
            min_tokens_to_keep=self.min_tokens_to_keep,
        )  # fmt: skip

        def kept(logprobs: mx.array) -> mx.array:
            with random_state_kept():
                return sample(logprobs)

        return kept

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution mlx-lm's sampler draws from, for each row of `logits` (its
        filters in its order: top-p, min-p, top-k)."""

        with random_state_kept():
            return self._probs(logits)

    def _probs(self, logits: mx.array) -> mx.array:
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs.astype(mx.float32) * (1 / self.temp), axis=-1)


def leading_run(matches: mx.array) -> mx.array:
    """The length of the leading run of True along the last axis of `matches` [..., K]
    (int32; 0-d for [K])."""
    return mx.cumprod(matches.astype(mx.int32), axis=-1).sum(axis=-1).astype(mx.int32)


def greedy_verdict(logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Keep the drafts equal to the backbone's argmax (of its log-probabilities, as mlx-lm's
    greedy sampler takes it); `logits` [K+1, V], `drafts` [K]. Packed here: [the K+1
    argmaxes, the drafts]; `read_verdict` finds the leading matches on the host, which costs
    fewer device operations than counting them on the device."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    return packed_greedy(targets, drafts), targets


def packed_greedy(targets: mx.array, drafts: mx.array) -> mx.array:
    """A greedy verdict's packing: the K+1 argmaxes [K+1], then the K drafts."""
    return mx.concatenate([targets, drafts])


def packed_plain(token: mx.array) -> mx.array:
    """A sampled verdict over no drafts: none kept, then `token` (a 0-d draw)."""
    return mx.concatenate([mx.zeros((1,), mx.int32), token.astype(mx.int32)[None]])


def accepted_counts(packs: list[mx.array], depths: list[int], greedy: list[bool]) -> mx.array:
    """Each packed verdict's accepted drafts [B] int32, on the device, as `verdict_of` reads
    them on the host (greedy: the targets, then the drafts, matched up to the first miss;
    sampled: the count first); `depths[r]`: the drafts pack r verified. Greedy packs of
    one depth: one comparison."""
    if all(greedy) and len(set(depths)) == 1:
        d = depths[0]
        if d == 0:
            return mx.zeros((len(packs),), dtype=mx.int32)
        packed = mx.stack(packs)
        return leading_run(packed[:, d + 1 :] == packed[:, :d])
    counts = []
    for pack, d, g in zip(packs, depths, greedy, strict=True):
        if not g:
            counts.append(pack[0])
        elif d == 0:
            counts.append(mx.zeros((), dtype=mx.int32))
        else:
            counts.append(leading_run(pack[d + 1 :] == pack[:d]))
    return mx.stack(counts)


def sampled_verdict(
    target: mx.array, draft: mx.array, drafts: mx.array, key: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """Exact speculative sampling (Leviathan et al., 2023), all positions at once.

    `target` [K+1, V] are the backbone's distributions after each verify input, `draft`
    [K, V] the proposer's distributions each draft was drawn from. Draft j is kept with
    probability min(1, p_j(d)/q_j(d)); on the first rejection the recovered token is drawn
    from normalize(max(p_j - q_j, 0)); when all are accepted, the bonus token from p_K. Each position gets its own
    uniform and its own residual draw; only those up to the first rejection are used, so the
    decisions are the sequential algorithm's.

    `key`: draw from this PRNG key instead of MLX's global state (a batch row's own seed).

    Written here because mlx-lm's `speculative_generate_step` keeps a draft only when it
    equals a token sampled from the target: also lossless, but it accepts with probability
    sum(p q) instead of sum(min(p, q)), which wastes most drafts at a temperature.
    """
    k = drafts.shape[0]
    drafts = drafts.astype(mx.int32)
    p = mx.take_along_axis(target[:k], drafts[:, None], axis=-1)[:, 0]
    q = mx.take_along_axis(draft, drafts[:, None], axis=-1)[:, 0]
    keys = mx.random.split(key) if key is not None else (None, None)
    u = mx.random.uniform(shape=(k,), key=keys[0])
    kept = leading_run((q > 0) & (u * q < p))  # u < min(1, p/q), as u < 1
    residual = mx.maximum(target[:k] - draft, 0.0)
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, target[:k])
    rows = mx.concatenate([residual, target[k:]])
    samples = mx.random.categorical(mx.log(rows), key=keys[1]).astype(mx.int32)
    token = samples[kept]
    packed = mx.concatenate([kept[None], token[None], drafts])
    positions = mx.arange(k + 1)
    followers = mx.where(positions < kept, mx.concatenate([drafts, token[None]]), token)
    return packed, followers


def verdict(
    logits: mx.array, drafts: mx.array, dists: mx.array | None, sampling: SamplingSettings
) -> tuple[mx.array, mx.array]:
    """`packed` [K+2] and `followers` [K+1] (see the module's docstring), lazily."""
    if sampling.greedy:
        return greedy_verdict(logits, drafts)
    return sampled_verdict(sampling.probs(logits), dists, drafts)


@dataclass(frozen=True)
class Verdict:
    """A round's verdict on the host: `accepted` drafts kept, then `token` (the bonus or
    recovered token); `drafts` as verified; greedy: `targets`, the target's argmax after
    each verify input [K+1]."""

    accepted: int
    token: int
    drafts: list[int]
    targets: list[int] | None = None

    @property
    def confirmed(self) -> list[int]:
        return self.drafts[: self.accepted] + [self.token]

    def holding(self, accepted: int) -> Verdict:
        """The greedy verdict that keeps `accepted` drafts, the target's token after them
        (bench's oracle holds a random-weight model to its plan)."""
        assert self.targets is not None, "a greedy verdict"
        return Verdict(accepted, self.targets[accepted], self.drafts, self.targets)


def read_verdict(packed: mx.array, greedy: bool) -> Verdict:
    """The round's one host read of `packed` (the only reader of its layout)."""
    return verdict_of(packed.tolist(), greedy)


def verdict_of(values: list[int], greedy: bool) -> Verdict:
    """The `Verdict` of a packed verdict read to the host (a batch reads all rows at once)."""
    if not greedy:
        kept, token, *drafts = values
        return Verdict(kept, token, drafts)
    k = (len(values) - 1) // 2
    targets, drafts = values[: k + 1], values[k + 1 :]
    kept = 0
    while kept < k and drafts[kept] == targets[kept]:
        kept += 1
    return Verdict(kept, targets[kept], drafts, targets)


def placeholder_verdict(depth: int, greedy: bool, logits: mx.array) -> mx.array:
    """The shape `verdict` packs, computed after `logits` (a rank that reads rank 0's
    verdict, `mtpkit.runtime.ranks`)."""
    size = 2 * depth + 1 if greedy else depth + 2
    return mx.depends(mx.zeros((size,), dtype=mx.int32), [logits])


def followers_of(packed: mx.array, depth: int, greedy: bool) -> mx.array:
    """The confirmed token after each verify input [K+1], from a packed verdict: what every
    rank computes from rank 0's shared verdict."""
    if greedy:  # [the K+1 argmaxes, the drafts]
        return packed[: depth + 1]
    kept, token, drafts = packed[0], packed[1], packed[2:]
    positions = mx.arange(depth + 1)
    return mx.where(positions < kept, mx.concatenate([drafts, token[None]]), token)


def rejection_sample(target: mx.array, draft: mx.array, drafts: list[int]) -> tuple[int, int]:
    """`sampled_verdict` for drafts given as a list: how many to keep, and the next token."""
    packed, _ = sampled_verdict(target, draft, mx.array(drafts, dtype=mx.int32))
    v = read_verdict(packed, greedy=False)
    return v.accepted, v.token
