"""What every model family supplies: data about its MTP head and a few hooks.

A family is built from a checkpoint's `config.json`. Key names are always derived from the
config (the nextn layer of DeepSeek/GLM sits at `model.layers.{num_hidden_layers}`, whatever
that number is), never written as literals.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from mtpkit.core.config import as_count, require_count
from mtpkit.families.head import MtpHead
from mtpkit.mlxlm import mlx_lm_models

EXPERT_INDEX = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+?)(?:\.weight)?$"
)


@dataclass(frozen=True)
class BackboneParts:
    """Where a loaded mlx-lm model keeps what an MTP head works with; its family says
    (`Family.backbone_parts`), so no other module names a model's attributes."""

    text: Any  # the text model: owns `lm_head` and the `args` the head shares
    decoder: Any  # the module holding the stack (mlx-lm's `pipeline()` lives there)
    embedding: Any  # token embedding: [V] ids -> [V, H] table
    layers: list[Any]  # the decoder stack, input to output
    final_norm: Any  # the norm before `lm_head`; the head drafts from its input or output
    lm_head: Any | None  # None: tied, the embedding's `as_linear`

    def logits(self, x: Any) -> Any:
        """`lm_head` over hidden states `x` [..., H]: logits [..., V]."""
        return self.lm_head(x) if self.lm_head is not None else self.embedding.as_linear(x)


# -- conversion hooks (used by mtpkit.convert.pipeline) ------------------------------------------------

# Buffers some checkpoints save that no model uses (precomputed rotary frequencies).
UNUSED_BUFFERS = ("rotary_emb.inv_freq",)


class ConvertHooks:
    """Mixin with the conversion hooks every family shares; families override the data.

    Names go through two steps: `rename` maps a checkpoint name to the name mlx-lm's model
    (backbone) or mtpkit's head file (head) uses, then `transform` (in mtpkit.convert.pipeline) applies
    the family-independent tensor rules (stack experts, split fused experts, conv1d layout,
    the norm shift). Every rule is keyed on names and shapes, so a converted tensor passes
    through unchanged: converting twice changes nothing.
    """

    # 1-D tensors whose name ends with one of these are zero-centred (shifted +1) in a raw
    # checkpoint; mlx-lm's qwen3_5/qwen3_next sanitize uses this very list for the backbone.
    backbone_norm_suffixes: ClassVar[tuple[str, ...]] = ()
    head_norm_suffixes: ClassVar[tuple[str, ...]] = ()
    # Hybrid families store a depthwise conv1d as [C, 1, K]; mlx wants [C, K, 1].
    has_conv1d: ClassVar[bool] = False
    # A per-expert projection's name once stacked, where mlx-lm's `switch_mlp` names it
    # otherwise (Nemotron-H's SwitchMLP: `up_proj` -> `fc1`, `down_proj` -> `fc2`).
    expert_projections: ClassVar[dict[str, str]] = {}

    config: dict[str, Any]
    text_config: dict[str, Any]

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(
            self.text_config.get(
                "tie_word_embeddings", self.config.get("tie_word_embeddings", False)
            )
        )

    def rename_backbone(self, name: str) -> str | None:
        """The mlx-lm parameter name of a backbone tensor, or None to drop it (as mlx-lm does)."""
        if name.endswith(UNUSED_BUFFERS):
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name

    def declare_mtp(self, config: dict[str, Any], layers: int) -> None:
        """Write the MTP layer count into `config` in this family's own field."""
        config["num_nextn_predict_layers"] = layers

    def split_tensor(self, name: str) -> list[tuple[str, Any]] | None:
        """Family-specific splits of one tensor into several: (new name, function of the
        array) pairs, or None to keep it whole."""
        return None


class Family(ConvertHooks):
    """Base class; one subclass per `model_type` in `mtpkit/families/<model_type>.py`.

    A subclass is data: its names, where its MTP tensors sit (the rename table below), its
    norm-shift sets, required tensors, config field, and ONE head class (`head_class`, built
    from the mlx-lm module `mlx_module`'s `block_class`) that both conversion
    (`head_module`) and the runtime (`build_head`) use.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    # Zero-centred RMSNorm weights (the model applies 1 + w): Qwen3-Next, Qwen3.5, Qwen3.6.
    zero_centred_norms: ClassVar[bool] = False
    # Order of the two normed inputs to the MTP projection.
    concat_order: ClassVar[str] = "embedding_first"
    # Tensors (other than experts) an MTP layer must have, relative to its layer prefix.
    required_mtp_tensors: ClassVar[tuple[str, ...]] = ()
    # The config field that declares the MTP layers (dotted when nested).
    config_field: ClassVar[str] = "num_nextn_predict_layers"
    # Whether published configs declare their MTP layers (Qwen3-Next's and LongCat's do not).
    declared_upstream: ClassVar[bool] = True
    # Whether published checkpoints of the family carry an MTP head (dense decoders such as
    # Llama get theirs from `mtpkit train-head`).
    ships_head: ClassVar[bool] = True
    # A standalone drafter (Gemma 4's assistant): every tensor of its checkpoint is the
    # drafter's, and it runs beside a target model rather than inside one.
    standalone: ClassVar[bool] = False

    # -- the rename table: raw root -> head name -------------------------------------------
    # Where mtpkit's sidecar keeps the head's tensors, before the head-relative name.
    head_prefix: ClassVar[str] = "mtp."
    # Roots under which a checkpoint keeps the whole head (Qwen: `mtp.`, `model.mtp.`, ...):
    # `{root}{rest}` becomes `{head_prefix}{rest}`.
    raw_head_roots: ClassVar[tuple[str, ...]] = ()
    # Root of raw MTP layer i, `{layer}` standing for `mtp_layer_offset() + i`:
    # `{root}{rest}` becomes `{head_prefix}layers.{i}.{rest}`.
    raw_layer_root: ClassVar[str | None] = None
    # Tensors inside an MTP layer that copy a backbone tensor (relative name -> original).
    duplicates: ClassVar[dict[str, str]] = {}
    # Where the head's tensors may sit in a model directory (sidecar, inline), tried in order.
    head_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)
    # Whether the head may also be written into the model shards (`convert --layout inline`):
    # only where mlx-lm's own model class keeps it there (Qwen3.5/3.6).
    inline_layout: ClassVar[bool] = False

    # -- the backbone: where mlx-lm's model class keeps its parts (`backbone_parts`) ---------
    # The decoder stack's attribute on the text model, and the embedding's and final norm's
    # on the decoder stack (mlx-lm's common names; Nemotron-H: backbone, embeddings, norm_f).
    decoder_attr: ClassVar[str] = "model"
    embedding_attr: ClassVar[str] = "embed_tokens"
    final_norm_attr: ClassVar[str] = "norm"

    # -- the head module -----------------------------------------------------------------
    head_class: ClassVar[type[MtpHead]]
    # `mlx_lm.models.<mlx_module>`: the decoder block class and the args class of the head.
    mlx_module: ClassVar[str]
    block_class: ClassVar[str]
    args_class: ClassVar[str] = "ModelArgs"

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.text_config: dict[str, Any] = config.get("text_config") or config

    # -- config facts ------------------------------------------------------------------
    def declared_mtp_layers(self) -> int | None:
        """MTP layers the config declares; None when the config has no such field."""
        key = self.config_field.rsplit(".", 1)[-1]
        value = self.text_config.get(key)
        if value is None:
            value = self.config.get(key)
        # A value that is not an integer ("one") declares nothing; `mtpkit.checkpoint.validate` names it.
        return None if value is None else as_count(value)

    def config_mtp_layers(self, head_layers: int) -> int:
        """The MTP layers a config declares for a head of `head_layers` layer groups
        (`layers.{i}`): the same number, except where one MTP layer spans several blocks."""
        return head_layers

    def mtp_field(self) -> str:
        """The config field that declares MTP layers for this family."""
        return self.config_field

    @property
    def num_hidden_layers(self) -> int:
        return require_count(self.text_config, "num_hidden_layers")

    @property
    def num_experts(self) -> int:
        key = "num_experts" if self.text_config.get("num_experts") else "n_routed_experts"
        return require_count(self.text_config, key, default=0)

    def mtp_layer_offset(self) -> int:
        """The raw index of MTP layer 0 (`raw_layer_root`), read from the config."""
        return 0

    # -- tensor names --------------------------------------------------------------------
    @functools.cached_property
    def _roots(self) -> re.Pattern[str]:
        alternatives = [re.escape(root) for root in self.raw_head_roots]
        if self.raw_layer_root is not None:
            layer = re.escape(self.raw_layer_root).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
            alternatives.append(layer)
            # A converted head's layer (`mtp.layers.{i}.`) is already in head naming.
            alternatives.append(re.escape(self.head_prefix) + r"layers\.\d+\.")
        return re.compile(f"^(?P<root>{'|'.join(alternatives)})")

    def _match(self, name: str) -> re.Match[str] | None:
        m = self._roots.match(name)
        if m is None or self.raw_layer_root is None or m["layer"] is None:
            return m
        return m if int(m["layer"]) >= self.mtp_layer_offset() else None

    def is_mtp_tensor(self, name: str) -> bool:
        return self._match(name) is not None

    def mtp_layer_prefix(self, name: str) -> str | None:
        """The prefix of the MTP layer a tensor belongs to (for grouping and completeness)."""
        m = self._match(name)
        return m["root"] if m else None

    def duplicate_of(self, name: str) -> str | None:
        """For MTP tensors that copy a backbone tensor, the original's name."""
        root = self.mtp_layer_prefix(name)
        return None if root is None else self.duplicates.get(name[len(root) :])

    def head_relative(self, name: str) -> str | None:
        """An MTP tensor's name inside the head (`layers.0.enorm.weight`), or None."""
        m = self._match(name)
        if m is None:
            return None
        rest = name[m.end() :]
        if self.raw_layer_root is None:
            return rest
        if m["layer"] is None:  # already `{head_prefix}layers.{i}.`
            return name[len(self.head_prefix) :]
        return f"layers.{int(m['layer']) - self.mtp_layer_offset()}.{rest}"

    def rename_head(self, name: str) -> str:
        """The mtpkit head name (`head_prefix` + path) of an MTP tensor."""
        relative = self.head_relative(name)
        assert relative is not None, name
        return self.head_prefix + relative

    def raw_head_tensors(self, names: Iterable[str]) -> dict[str, str]:
        """Raw MTP layer tensors (`raw_layer_root`) among `names` -> head-relative names,
        without the copies of backbone tensors."""
        if self.raw_layer_root is None:
            return {}
        out = {}
        for name in names:
            m = self._match(name)
            if m is not None and m["layer"] is not None and self.duplicate_of(name) is None:
                out[name] = f"layers.{int(m['layer']) - self.mtp_layer_offset()}.{name[m.end() :]}"
        return out

    def raw_head_label(self) -> str:
        """How a report names where a raw checkpoint keeps the head."""
        return (self.raw_layer_root or "").format(layer="{N}")

    # -- norms -------------------------------------------------------------------------------
    def shifts_head_norm(self, relative: str) -> bool:
        """Whether a head tensor (head-relative name) is in the zero-centred norm-shift set."""
        return (self.head_prefix + relative).endswith(self.head_norm_suffixes)

    # -- the head module -------------------------------------------------------------------
    def head_block(self) -> type[Any]:
        """mlx-lm's decoder block class that the head's layers are built from."""
        return getattr(mlx_lm_models(self.mlx_module), self.block_class)

    def text_model(self, model: Any) -> Any:
        """The part of an mlx-lm model whose `args` the head shares."""
        return model

    def backbone_parts(self, model: Any) -> BackboneParts:
        """The embedding, decoder layers, final norm and lm_head of a loaded mlx-lm model."""
        text = self.text_model(model)
        decoder = getattr(text, self.decoder_attr)
        return BackboneParts(
            text=text,
            decoder=decoder,
            embedding=getattr(decoder, self.embedding_attr),
            layers=list(decoder.layers),
            final_norm=getattr(decoder, self.final_norm_attr),
            lm_head=text.get("lm_head"),
        )

    def head_args(self, model: Any = None) -> Any:
        """mlx-lm's args for the head: the model's own when given, else from the config."""
        if model is not None:
            return self.text_model(model).args
        args_class = getattr(mlx_lm_models(self.mlx_module), self.args_class)
        return args_class.from_dict(self.args_config())

    def args_config(self) -> dict[str, Any]:
        return self.config

    def build_head(
        self, num_layers: int = 1, names: Iterable[str] = (), *, args: Any = None
    ) -> MtpHead:
        """The family's head with `num_layers` layers, randomly initialised (load weights
        next); `names`, the head tensors when known, settle optional parameters."""
        args = self.head_args() if args is None else args
        head = self.head_class.build(args, self.head_block(), num_layers, names)
        head.family = self.name
        return head

    def head_module(self, model: Any, layers: int, names: Iterable[str] = ()) -> Any:
        """The head (`layers` MTP layers) rooted at `head_prefix`, built from the model's
        args: its parameter tree tells conversion which head tensors exist, their shapes, and
        which modules mlx-lm can quantize. Nothing is computed."""
        head = self.build_head(layers, names, args=self.head_args(model))
        return rooted(head, self.head_prefix)

    # -- pairing with a drafter of its own (inspect's `pairing`) ------------------------------
    def pairing(self) -> dict[str, Any] | None:
        """What pairs this model with a standalone drafter (Gemma 4 and its assistant), or
        None for a family without one."""
        return None

    def build_model(self) -> Any:
        """A standalone drafter's whole model (mlx-lm builds every other family's)."""
        raise NotImplementedError(f"{self.name} is not a standalone drafter")

    def checkpoint_problems(self, shapes: dict[str, tuple[int, ...]]) -> list[tuple[str, str]]:
        """A standalone drafter's (code, message) problems, from its tensor shapes."""
        return []

    # -- checks ----------------------------------------------------------------------------
    def missing_mtp_tensors(self, names: Iterable[str]) -> list[str]:
        """Required head tensors absent from `names` (one entry per missing tensor)."""
        names = set(names)
        layers = sorted({p for n in names if (p := self.mtp_layer_prefix(n))})
        missing = []
        for layer in layers:
            for rel in self.required_mtp_tensors:
                if (
                    f"{layer}{rel}" not in names
                    and f"{layer}{rel}".removesuffix(".weight") not in names
                ):
                    missing.append(f"{layer}{rel}")
        return missing


def rooted(module: Any, prefix: str) -> Any:
    """Nest `module` under the dotted `prefix` (e.g. `language_model.mtp.`)."""
    import mlx.nn as nn

    for part in reversed(prefix.rstrip(".").split(".")):
        parent = nn.Module()
        setattr(parent, part, module)
        module = parent
    return module


# -- the registry --------------------------------------------------------------------------

REGISTRY: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family findable by its `name` and `aliases`."""
    for key in (cls.name, *cls.aliases):
        if key in REGISTRY and REGISTRY[key] is not cls:
            raise ValueError(f"model_type {key!r} is registered twice")
        REGISTRY[key] = cls
    return cls


def expert_layout(names: Iterable[str]) -> str | None:
    """How the MTP head stores its experts, from its tensor names."""
    names = list(names)
    if not names:
        return None
    if any(EXPERT_INDEX.match(n) for n in names):
        return "per_expert"
    if any(n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj") for n in names):
        return "fused"
    if any(".switch_mlp." in n for n in names):
        return "stacked"
    return "dense"


GLU_PROJECTIONS = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def incomplete_experts(
    names: dict[str, tuple[int, ...]], num_experts: int, projections: dict[str, str] | None = None
) -> list[str]:
    """Messages for expert sets that do not cover 0..num_experts-1 with all projections
    (`projections`: per-expert name -> stacked name, a family's `expert_projections`; a
    gated MLP's three by default)."""
    projections = projections or GLU_PROJECTIONS
    problems: list[str] = []
    per_expert: dict[str, dict[str, set[int]]] = {}
    for n in names:
        m = EXPERT_INDEX.match(n)
        if m and m["proj"] in projections:
            per_expert.setdefault(m["prefix"], {}).setdefault(m["proj"], set()).add(
                int(m["expert"])
            )
    for prefix, projs in sorted(per_expert.items()):
        for proj in projections:
            have = projs.get(proj, set())
            missing = sorted(set(range(num_experts)) - have)
            extra = sorted(have - set(range(num_experts)))
            if missing:
                problems.append(
                    f"{prefix}.*.{proj}: {len(missing)} of {num_experts} experts missing "
                    f"(first: {missing[0]})"
                )
            if extra:
                problems.append(
                    f"{prefix}.*.{proj}: expert ids {extra[:3]} exceed num_experts={num_experts}"
                )
    fused = {n.rsplit(".", 1)[0] for n in names if n.endswith("experts.gate_up_proj")}
    fused |= {n.rsplit(".", 1)[0] for n in names if n.endswith("experts.down_proj")}
    for prefix in sorted(fused):
        for part in ("gate_up_proj", "down_proj"):
            shape = names.get(f"{prefix}.{part}")
            if shape is None:
                problems.append(f"{prefix}.{part} missing from the fused experts")
            elif num_experts and shape[0] != num_experts:
                problems.append(
                    f"{prefix}.{part} holds {shape[0]} experts, config says {num_experts}"
                )
    stacked = {n.split(".switch_mlp.")[0] for n in names if ".switch_mlp." in n}
    for prefix in sorted(stacked):
        for proj in projections.values():
            shape = names.get(f"{prefix}.switch_mlp.{proj}.weight")
            if shape is None:
                problems.append(f"{prefix}.switch_mlp.{proj}.weight missing")
            elif num_experts and shape[0] != num_experts:
                problems.append(
                    f"{prefix}.switch_mlp.{proj}.weight holds {shape[0]} experts, config says {num_experts}"
                )
    return problems
