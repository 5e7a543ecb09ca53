"""The model at run time: stock mlx-lm's backbone, the MTP head, and two taps on the backbone.

- The backbone is mlx-lm's own model class, loaded by `mlx_lm.utils.load_model` with a
  subclass whose `sanitize` first sets the head's tensors aside (some checkpoints keep them in
  a `model*.safetensors` file that mlx-lm reads). The head comes from `mtpkit.runtime.headload`.
- A tap on the final norm keeps the last hidden state (its input for `pre_norm`, its output
  for `post_norm`): the head drafts from it.
- A verify pass (`MtpModel.verify`) can be rolled back to any accepted prefix: trimmable
  caches are trimmed, gated-delta-net states restored from what `mtpkit.runtime.rollback.gdn` captured, and
  any other non-trimmable cache restored and replayed (`mtpkit.runtime.rollback.replay`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.checkpoint.headers import require_valid_headers
from mtpkit.checkpoint.source import HubSource, open_source
from mtpkit.checkpoint.tokenizer import (  # noqa: F401 (callers import them from here)
    RemoteCodeRequired,
    StdinClosed,
    library_io,
    load_tokenizer,
)
from mtpkit.core.choices import DEFAULT_HIDDEN, HIDDEN_VARIANTS, POST_NORM
from mtpkit.core.errors import MtpkitError
from mtpkit.families import BackboneParts, backbone_parts
from mtpkit.mlxlm import eval_private_arrays, stock_model_classes
from mtpkit.runtime.draft_vocab import FullVocab, SubsetVocab, load_draft_vocab
from mtpkit.runtime.headload import HeadWeights, MtpHead, load_head
from mtpkit.runtime.kernels.attention import MAX_QUERIES, few_query_attention
from mtpkit.runtime.kernels.gdn_verify import use_fast_verify
from mtpkit.runtime.kernels.prompt import prompt_chunk
from mtpkit.runtime.kernels.routing import multi_row_matmuls
from mtpkit.runtime.ranks import SINGLE, Lockstep
from mtpkit.runtime.rollback.gdn import (
    GdnSnapshots,
    capture_gdn_states,
    is_recurrent_cache,
    tap_gated_delta_layers,
)
from mtpkit.runtime.rollback.replay import CacheReplay, gdn_covers
from mtpkit.runtime.rollback.verify_pass import VerifyPass
from mtpkit.runtime.upcast import moe_dtype, upcast_experts

# What mlx-lm needs from a Hub repo to load a model and its tokenizer.
MODEL_FILES = ("*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja")
# A tokenizer mlx-lm (through transformers) can build: one of these is needed.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "*.tiktoken",
    "tiktoken.model",
    "vocab.txt",
    "spiece.model",
)
HEAD_TENSOR_PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.", "model.mtp_layers.")


class GenerateError(MtpkitError):
    """Bad generate options."""


class NoMtpHead(MtpkitError):
    """`--mtp` was asked of a model without a usable MTP head."""


# ---------------------------------------------------------------------------------------
# The final-norm tap: the hidden state the head drafts from.


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


class LayerCapture:
    """The outputs of chosen decoder layers in the last forward pass, in the order chosen:
    what a block drafter (DFlash) reads of its target (transformers' `hidden_states[l + 1]`)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers

    def features(self) -> mx.array:
        """[1, T, n*H]: the tapped layers' outputs, concatenated on the last axis."""
        return mx.concatenate([layer._mtpkit_output for layer in self.layers], axis=-1)


def tap_layers(layers: list[nn.Module], ids: tuple[int, ...]) -> LayerCapture:
    """Make layers `ids` of `layers` record their output, keeping their class, weights and
    result (as `tap_final_norm` does: a subclass per instance; tapping twice is a no-op)."""
    for i in ids:
        layer = layers[i]
        base = type(layer)
        if getattr(base, "_mtpkit_layer_tap", False):
            continue

        def __call__(self: nn.Module, *args: Any, _base: type = base, **kwargs: Any) -> Any:
            out = _base.__call__(self, *args, **kwargs)
            self._mtpkit_output = out
            return out

        layer.__class__ = type(
            f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtpkit_layer_tap": True}
        )
    return LayerCapture([layers[i] for i in ids])


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
    parts: BackboneParts
    # The ranks this model is spread over (`mtpkit.runtime.sharded`); one process by default.
    lockstep: Lockstep = SINGLE
    # True on a rank without the head while rank 0 has one (a non-last pipeline stage).
    head_elsewhere: bool = False
    # The ids the head drafts over when `convert --draft-vocab` chose a subset.
    draft_vocab: SubsetVocab | None = None

    @property
    def drafting(self) -> FullVocab:
        """The vocabulary the head drafts over (`mtpkit.runtime.draft_vocab`): the subset,
        or every token through `lm_head`."""
        return self.draft_vocab if self.draft_vocab is not None else FullVocab(self.lm_head)

    # Set by a block drafter: the hidden state is then the tapped layers' outputs.
    layer_taps: LayerCapture | None = None

    @property
    def has_head(self) -> bool:
        """Whether the decoding (on any rank) has an MTP head to draft with."""
        return self.head is not None or self.head_elsewhere

    @property
    def vocab_size(self) -> int | None:
        """The ids the model embeds and scores (its config's vocab_size), None if unknown."""
        for config in (self.config, self.config.get("text_config") or {}):
            size = config.get("vocab_size") if isinstance(config, dict) else None
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                return size
        return None

    @property
    def moe_dtype(self) -> str | None:
        """The dtype the MoE experts compute in (`mtpkit.runtime.upcast.moe_dtype`); None without."""
        return moe_dtype(self.model) or (moe_dtype(self.head) if self.head is not None else None)

    @property
    def final_norm(self) -> nn.Module:
        return self.parts.final_norm

    @property
    def embedding(self) -> nn.Module:
        return self.parts.embedding

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings [..., H] of `tokens` [...]."""
        return self.embedding(tokens)

    def lm_head(self, x: mx.array) -> mx.array:
        """Logits [..., V] of hidden states `x` [..., H] (tied: the embedding's as_linear).
        Under tensor parallelism mlx-lm may shard the lm_head by vocabulary (its
        `sharding_group`); the slices are gathered as mlx-lm's own forward gathers them, a
        collective every rank joins."""
        logits = self.parts.logits(x)
        group = getattr(self.parts.text, "sharding_group", None)
        if group is None or self.parts.lm_head is None:
            return logits
        from mlx_lm.models.base import gather_last_axis

        return gather_last_axis(logits, group)

    def tap_layers(self, ids: tuple[int, ...]) -> None:
        """From now on the hidden state of a pass is the outputs of backbone layers `ids`,
        concatenated (a block drafter's input); the logits are unchanged."""
        self.layer_taps = tap_layers(self.parts.layers, ids)

    def hidden_state(self) -> mx.array:
        if self.layer_taps is not None:
            return self.layer_taps.features()
        return self.capture.post if self.hidden == POST_NORM else self.capture.pre

    def make_cache(self, max_kv_size: int | None = None) -> list[Any]:
        """mlx-lm's caches for the backbone (rotating ones of `max_kv_size`, as mlx-lm's
        --max-kv-size makes them, for models without their own `make_cache`)."""
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model, max_kv_size=max_kv_size)

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Logits [1, T, V] and hidden states [1, T, H] of `tokens` [1, T] (a prompt's chunk
        on CUDA without a build for its length: `kernels.prompt`)."""
        if tokens.shape[1] <= MAX_QUERIES:
            logits = self.model(tokens, cache=cache)
        else:
            with prompt_chunk():
                logits = self.model(tokens, cache=cache)
        return logits, self.hidden_state()

    def verify(self, tokens: mx.array, cache: list[Any]) -> VerifyPass:
        """A forward pass over `tokens` [T] that can be rolled back to any prefix."""
        recurrent = any(is_recurrent_cache(c) for c in cache)
        replay = None
        if recurrent and not gdn_covers(self.model, cache, is_recurrent_cache):
            replay = CacheReplay.before(cache, tokens, lambda t, c: self.model(t, cache=c))
            recurrent = False
        snapshots = GdnSnapshots() if recurrent else None
        rows = tokens.shape[0]
        with (
            capture_gdn_states(snapshots),
            multi_row_matmuls(self.model, rows),
            few_query_attention(),
        ):  # MLX's conv: one stream meets few (1, depth) shapes, built once (kernels.prompt)
            logits, hidden = self.forward(tokens[None], cache)
        return VerifyPass(logits, hidden, snapshots, rows, replay)


# ---------------------------------------------------------------------------------------
# Loading.


def resolve_model_path(spec: str, revision: str | None = None) -> Path:
    """A local model directory, or the snapshot of a Hub repo with the files mlx-lm reads."""
    source = open_source(spec, revision=revision)
    if isinstance(source, HubSource):
        path = source.download(MODEL_FILES)  # each request bounded by the Hub timeouts
    else:
        local = Path(spec).expanduser()
        path = local if local.is_dir() else source.root  # else: an offline Hub snapshot
    if not (path / "config.json").exists():
        raise MtpkitError(f"{spec} has no config.json: pass a model directory")
    _validate_config(path, spec)
    names = require_valid_headers(path, spec)
    _require_quantization(path, spec, names)
    weights = any(path.glob("*.safetensors"))  # without any, the loader's own error says so
    if weights and not any(any(path.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise MtpkitError(
            f"{spec} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...): copy them "
            "from the original checkpoint into it"
        )
    return path


def _require_quantization(path: Path, spec: str, names: list[str]) -> None:
    """Quantized tensors need config.json's quantization block (`quantization_problem`)."""
    import json

    from mtpkit.checkpoint.validate import quantization_problem
    from mtpkit.core.errors import InvalidConfig

    problem = quantization_problem(json.loads((path / "config.json").read_text()), names)
    if problem is not None:
        raise InvalidConfig(f"{spec}: {problem.message} ({problem.code})")


def _validate_config(path: Path, spec: str) -> None:
    """config.json's values checked where inspect and convert check them, before mlx-lm
    builds a model from them (a word for a size, a string for `quantization`)."""
    import json

    from mtpkit.checkpoint.validate import require_tokenizer_fits, require_valid_config
    from mtpkit.core.config import load_json, require_config_object
    from mtpkit.core.errors import UnsupportedFamily
    from mtpkit.families import family_for

    try:
        config = load_json(
            (path / "config.json").read_text(encoding="utf-8"), f"config.json in {spec}"
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtpkitError(f"config.json in {spec} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise MtpkitError(f"config.json in {spec} is not a JSON object")
    require_config_object(config, spec)
    try:
        field = family_for(config).mtp_field()
    except UnsupportedFamily:  # a model mtpkit has no family for: mlx-lm decides
        field = "num_nextn_predict_layers"
    require_valid_config(config, field, spec)
    require_tokenizer_fits(config, path, spec)


def head_tensor_filter(config: dict[str, Any]) -> Callable[[str], bool]:
    """Names the tensors of the MTP head that the backbone never uses: the family's own rule
    (`Family.is_mtp_tensor`, which knows e.g. layers past `num_hidden_layers`) and, for a
    model mtpkit has no family for, the head prefixes of mtpkit's own layouts."""
    from mtpkit.core.errors import UnsupportedFamily
    from mtpkit.families import family_for

    try:
        family = family_for(config)
    except UnsupportedFamily:
        return lambda name: name.startswith(HEAD_TENSOR_PREFIXES)
    return lambda name: name.startswith(HEAD_TENSOR_PREFIXES) or family.is_mtp_tensor(name)


def model_classes_without(
    config: dict[str, Any], drop: Callable[[str], bool]
) -> tuple[type[nn.Module], type]:
    """mlx-lm's model class for `config`, whose sanitize first drops the tensors `drop` names."""
    model_cls, args_cls = stock_model_classes(config)

    class WithoutHead(model_cls):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            weights = {k: v for k, v in weights.items() if not drop(k)}
            return super().sanitize(weights) if hasattr(model_cls, "sanitize") else weights

    return WithoutHead, args_cls


def load_backbone(
    path: Path, *, lazy: bool = False, drop: Callable[[str], bool] | None = None
) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Stock mlx-lm's model (strictly loaded, the head's tensors set aside), tokenizer and
    config, as `mlx_lm.load` returns them. `drop` names the tensors to set aside (default:
    `head_tensor_filter` of the config)."""
    from mlx_lm.utils import load_model as mlx_load_model

    def classes(config: dict[str, Any]) -> tuple[type[nn.Module], type]:
        return model_classes_without(config, drop or head_tensor_filter(config))

    try:
        model, config = mlx_load_model(path, lazy=lazy, get_model_classes=classes)
    except (ValueError, FileNotFoundError) as e:
        raise MtpkitError(f"mlx-lm cannot load {path}: {e}") from None
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id", None))
    return model, tokenizer, config


_BACKBONES: dict[tuple[str, float], tuple[nn.Module, Any, dict[str, Any]]] = {}


def _backbone_key(path: Path) -> tuple[str, float] | None:
    """The last loaded backbone is reused while its files are unchanged."""
    try:
        stamps = [p.stat().st_mtime for p in path.glob("*.safetensors")]
        stamps.append((path / "config.json").stat().st_mtime)
    except OSError:
        return None
    return str(path.resolve()), max(stamps)


def _cached_backbone(path: Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    key = _backbone_key(path)
    if key is not None and key in _BACKBONES:
        return _BACKBONES[key]
    loaded = load_backbone(path)
    if key is not None:
        _BACKBONES.clear()  # keep one: a check measures one model many times
        _BACKBONES[key] = loaded
    return loaded


def load_model(
    spec: str | Path,
    *,
    hidden: str | None = None,
    concat_order: str | None = None,
    norm_shift: float = 0.0,
    with_head: bool = True,
    revision: str | None = None,
    adapter_path: str | Path | None = None,
) -> MtpModel:
    """Load a model directory with stock mlx-lm and attach its MTP head (if it has one);
    `adapter_path`: LoRA adapters applied to the backbone, as `mlx_lm.load` applies them."""
    path = resolve_model_path(str(spec), revision)
    if adapter_path is None:
        model, tokenizer, config = _cached_backbone(path)
    else:  # a model of its own: the cached backbone stays as it was loaded
        from mtpkit.mlxlm import apply_adapters

        model, tokenizer, config = load_backbone(path)
        apply_adapters(model, adapter_path)
    head = head_weights = None
    if with_head:
        loaded = load_head(path, config, norm_shift=norm_shift, concat_order=concat_order)
        if loaded is not None:
            head, head_weights = loaded
    return assemble(path, model, tokenizer, config, head, head_weights, hidden)


def assemble(
    path: Path,
    model: nn.Module,
    tokenizer: Any,
    config: dict[str, Any],
    head: MtpHead | None,
    head_weights: HeadWeights | None,
    hidden: str | None,
    lockstep: Lockstep = SINGLE,
    head_elsewhere: bool = False,
) -> MtpModel:
    """A loaded backbone and head made ready to decode: experts upcast where MLX needs it,
    the final norm and the gated-delta-net layers tapped."""
    upcast_experts([model, head], what=str(path))
    eval_private_arrays(model)  # usable from another thread (the server's decoding thread)
    if hidden is None:
        manifest = head_weights.manifest if head_weights is not None else None
        hidden = (manifest or {}).get("hidden") or DEFAULT_HIDDEN
    if hidden not in HIDDEN_VARIANTS:
        raise GenerateError(f"--hidden must be one of {', '.join(HIDDEN_VARIANTS)}, not {hidden!r}")
    parts = backbone_parts(model, config)
    capture = tap_final_norm(parts.final_norm)
    tap_gated_delta_layers(model)
    use_fast_verify(model)  # CUDA only: one-kernel recurrence and multi-row matmuls
    text = config.get("text_config") or config
    context = text.get("max_position_embeddings") or config.get("max_position_embeddings")
    draft_vocab = None
    if head is not None and head_weights is not None:
        draft_vocab = _draft_vocab(path, head_weights, tokenizer, parts, config, lockstep)
    return MtpModel(
        path, model, tokenizer, config, head, head_weights, hidden, capture, context, parts,
        lockstep, head_elsewhere, draft_vocab,
    )  # fmt: skip


def _draft_vocab(
    path: Path, head_weights: HeadWeights, tokenizer: Any, parts: BackboneParts,
    config: dict[str, Any], lockstep: Lockstep,
) -> SubsetVocab | None:  # fmt: skip
    """The head's draft vocabulary (`convert --draft-vocab`); across ranks, whose lm_head
    may be sharded by vocabulary, the head drafts over every token."""
    if not (head_weights.manifest or {}).get("draft_vocab"):
        return None
    if lockstep is not SINGLE:
        from mtpkit.core.console import warn

        warn("across ranks the head drafts over every token (its --draft-vocab is not used)")
        return None
    text = config.get("text_config") or config
    vocab = int(text.get("vocab_size") or config.get("vocab_size") or 0)
    return load_draft_vocab(path, head_weights.manifest, tokenizer, parts, vocab)
