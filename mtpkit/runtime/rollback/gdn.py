"""Rolling a verify pass back: the gated-delta-net states kept for every verified position.

Trimmable caches (KV) drop rejected drafts by `trim`. A gated-delta-net layer (Qwen3.5/3.6,
Qwen3-Next) keeps a conv state and a recurrent state that cannot be trimmed, so during a
verify pass every such layer records its conv input and its recurrent state after each
verified token (`GdnSnapshots`), and `VerifyPass.rollback` restores the state after the
accepted prefix: a rejection never costs another forward pass.

The per-position states come from one replaceable function: by default it
runs mlx-lm's own `gated_delta_update` one token at a time; a faster implementation only has
to return the same outputs and states (see `set_gdn_verify_impl`; on a CUDA GPU
`mtpkit.runtime.kernels.gdn_verify` installs a one-launch kernel).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass
class GdnSnapshots:
    """Per-token states of every gated-delta-net layer during one verify pass, in layer
    order: the conv1d input (conv state plus the new tokens) and the recurrent state after
    each token."""

    conv_inputs: list[mx.array] = field(default_factory=list)
    # Per layer: a list of T states, or one array [T, ...] (a kernel's single output).
    states: list[list[mx.array] | mx.array] = field(default_factory=list)

    def restore(self, caches: list[Any], kept: int) -> None:
        """Set each layer's cache to its state after the first `kept` verified tokens."""
        for cache, conv_input, states in zip(caches, self.conv_inputs, self.states, strict=True):
            n_keep = cache[0].shape[1]
            cache[0] = mx.contiguous(conv_input[:, kept : kept + n_keep, :])
            cache[1] = state_after(states, kept)

    def restore_rows(self, caches: list[Any], kept: mx.array) -> None:
        """Set each layer's cache row r to its state after `kept[r]` verified tokens (kept
        [B] int32, each at least 1): the rows of a batch, each keeping its own count."""
        rows = mx.arange(kept.shape[0])
        for cache, conv_input, states in zip(caches, self.conv_inputs, self.states, strict=True):
            n_keep = cache[0].shape[1]
            window = (kept[:, None] + mx.arange(n_keep)[None, :])[..., None]
            cache[0] = mx.take_along_axis(conv_input, window, axis=1)
            stacked = states if isinstance(states, mx.array) else mx.stack(states)
            cache[1] = stacked[kept - 1, rows]


def state_after(states: list[mx.array] | mx.array, n: int) -> mx.array:
    """The recurrent state after the first `n` tokens of a verify pass, from its per-token
    states: a list, or one array [T, ...] whose row is taken as a view (a slice, no copy:
    taking every row apart would cost two graph nodes per token and layer)."""
    if isinstance(states, mx.array):
        return states[n - 1 : n].reshape(states.shape[1:])
    return states[n - 1]


_ACTIVE_SNAPSHOTS: contextvars.ContextVar[GdnSnapshots | None] = contextvars.ContextVar(
    "mtpkit_gdn_snapshots", default=None
)
_PATCHED_MODULES: set[str] = set()


@contextlib.contextmanager
def capture_gdn_states(snapshots: GdnSnapshots | None) -> Iterator[GdnSnapshots | None]:
    """Within the block, the tapped gated-delta-net layers fill `snapshots` (None: off)."""
    token = _ACTIVE_SNAPSHOTS.set(snapshots)
    try:
        yield snapshots
    finally:
        _ACTIVE_SNAPSHOTS.reset(token)


def stepwise_verify(
    original: Callable[..., Any], q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs
):  # noqa: N803
    """The reference verify: mlx-lm's own `original` update run one token at a time (the
    same sequential recurrence mlx-lm runs). Returns the outputs [B, T, ...] and the list of
    the T states after each token."""
    ys, states = [], []
    for t in range(q.shape[1]):
        step = slice(t, t + 1)
        y, state = original(
            q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias,
            state, None if mask is None else mask[:, step], **kwargs,
        )  # fmt: skip
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), states


# The function a verify pass of T > 1 tokens uses; same signature and results as
# `stepwise_verify` (its per-token states may also come as one array [T, ...]). Replaced
# with `set_gdn_verify_impl` (e.g. by a fused T-token kernel).
_VERIFY_IMPL: list[Callable[..., Any]] = [stepwise_verify]


def set_gdn_verify_impl(impl: Callable[..., Any]) -> Callable[..., Any]:
    """Use `impl` for verify passes from now on; returns the one it replaces."""
    previous = _VERIFY_IMPL[0]
    _VERIFY_IMPL[0] = impl
    return previous


# The function every other call uses (a prefill chunk, a plain step): mlx-lm's own update
# unless replaced with `set_gdn_plain_impl` (on CUDA, where mlx-lm runs a loop of small ops
# per token, by a one-launch kernel); same signature as `stepwise_verify`, mlx-lm's results.
_PLAIN_IMPL: list[Callable[..., Any] | None] = [None]


def set_gdn_plain_impl(impl: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """Use `impl` outside verify passes from now on (None: mlx-lm's own); returns the one
    it replaces."""
    previous = _PLAIN_IMPL[0]
    _PLAIN_IMPL[0] = impl
    return previous


def _capturing_gated_delta_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap mlx-lm's `gated_delta_update` so that, inside a verify pass, it keeps the state
    after each token. Outside a verify pass it is the original function."""

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):  # noqa: N803
        snapshots = _ACTIVE_SNAPSHOTS.get()
        if snapshots is None or q.shape[1] == 1:
            plain = _PLAIN_IMPL[0]
            if plain is None:
                out = original(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
            else:
                out = plain(original, q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
            if snapshots is not None:
                snapshots.states.append([out[1]])
            return out
        y, states = _VERIFY_IMPL[0](original, q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
        snapshots.states.append(states)
        return y, state_after(states, q.shape[1])

    update._mtpkit_original = original  # type: ignore[attr-defined]
    return update


def _patch_gated_delta(module_name: str) -> None:
    if module_name in _PATCHED_MODULES:
        return
    module = importlib.import_module(module_name)
    if hasattr(module, "gated_delta_update"):
        module.gated_delta_update = _capturing_gated_delta_update(module.gated_delta_update)
    _PATCHED_MODULES.add(module_name)


def _tap_conv_input(conv: nn.Module) -> None:
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


def gated_delta_net(layer: Any) -> nn.Module | None:
    """A decoder layer's gated-delta-net mixer, or None: mlx-lm's `GatedDeltaNet`, which its
    Qwen3-Next and Qwen3.5 layers keep as `linear_attn`."""
    return layer.get("linear_attn") if isinstance(layer, dict) else None


def tap_gated_delta_layers(model: nn.Module) -> int:
    """Prepare every gated-delta-net layer of `model` for `capture_gdn_states`; returns how
    many there are (tapping twice changes nothing)."""
    count = 0
    for layer in getattr(model, "layers", []):
        gdn = gated_delta_net(layer)
        if gdn is not None:
            _patch_gated_delta(type(gdn).__module__)
            _tap_conv_input(gdn.conv1d)
            count += 1
    return count


def is_recurrent_cache(cache: Any) -> bool:
    """A cache that cannot be trimmed but is restored from snapshots (gated delta net)."""
    from mlx_lm.models.cache import ArraysCache

    return isinstance(cache, ArraysCache)
