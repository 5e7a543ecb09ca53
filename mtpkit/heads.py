"""MTP head modules in MLX, one per family, built from mlx-lm's own layers.

Every family's head does the same "NextN" step (see docs/MTP_FORMATS.md):

    x = Proj(concat(NormE(embed(t_{k+1})), NormH(h_k)))   # the order is the family's
    x = DecoderBlock(x, mask, own KV cache)
    logits = lm_head(FinalNorm(x))                        # lm_head shared with the backbone

The decoder block is the family's mlx-lm decoder layer class (subclassed only to hang the
projection and norms on it where the checkpoint keeps them inside the layer), so attention,
MoE routing and quantized layers behave exactly as in the backbone. Parameter paths match
the head tensor names with the head prefix (`language_model.mtp.`, `mtp.`) removed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

EMBEDDING_FIRST = "embedding_first"
HIDDEN_FIRST = "hidden_first"
CONCAT_ORDERS = (EMBEDDING_FIRST, HIDDEN_FIRST)


class MtpHead(nn.Module):
    """Base class: subclasses expose `layers` and the four hooks below."""

    family: str = ""
    default_concat_order: str = EMBEDDING_FIRST
    # DeepSeek's MLA attention takes an array mask, never the "causal" shortcut.
    mask_as_array: bool = False

    def __init__(self) -> None:
        super().__init__()
        # A plain attribute (not a parameter): which input comes first in the projection.
        self._concat_order = self.default_concat_order

    # -- hooks ---------------------------------------------------------------------------
    def norm_embedding(self, i: int) -> nn.Module:
        raise NotImplementedError

    def norm_hidden(self, i: int) -> nn.Module:
        raise NotImplementedError

    def projection(self, i: int) -> nn.Module:
        raise NotImplementedError

    def final_norm(self, i: int) -> nn.Module:
        raise NotImplementedError

    # -- the step ------------------------------------------------------------------------
    @property
    def concat_order(self) -> str:
        return self._concat_order

    def set_concat_order(self, order: str) -> None:
        if order not in CONCAT_ORDERS:
            raise ValueError(f"concat order must be one of {CONCAT_ORDERS}, not {order!r}")
        self._concat_order = order

    def layer_for_step(self, step: int) -> int:
        """Which MTP layer drafts the `step`-th token ahead (vLLM: step % num_layers)."""
        return step % len(self.layers)

    def __call__(
        self,
        hidden: mx.array,
        embedded: mx.array,
        cache: list[Any] | None = None,
        step: int = 0,
    ) -> mx.array:
        """One head step over S positions: the block output, before the final norm.

        `hidden` [B, S, H] is the hidden state at positions k, `embedded` [B, S, H] the
        embedding of the token at k+1. The caller applies `final_norm` and the lm_head.
        """
        i = self.layer_for_step(step)
        e = self.norm_embedding(i)(embedded)
        h = self.norm_hidden(i)(hidden)
        parts = [e, h] if self._concat_order == EMBEDDING_FIRST else [h, e]
        x = self.projection(i)(mx.concatenate(parts, axis=-1))
        layer_cache = cache[i] if cache is not None else None
        mask = create_attention_mask(x, layer_cache, return_array=self.mask_as_array)
        return self.layers[i](x, mask, layer_cache)

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]


# ---------------------------------------------------------------------------------------
# Qwen3.5 / Qwen3.6 / Qwen3-Next: fc + pre_fc_norm_{embedding,hidden} + norm around a
# full-attention decoder layer of the backbone's own class.


class QwenMtpHead(MtpHead):
    def __init__(self, args: Any, layer_cls: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.norm = nn.RMSNorm(h, eps=eps)
        # The layer index only selects the layer type: the last of a full-attention period.
        full_attention_idx = args.full_attention_interval - 1
        self.layers = [layer_cls(args, full_attention_idx) for _ in range(num_layers)]

    def norm_embedding(self, i: int) -> nn.Module:
        return self.pre_fc_norm_embedding

    def norm_hidden(self, i: int) -> nn.Module:
        return self.pre_fc_norm_hidden

    def projection(self, i: int) -> nn.Module:
        return self.fc

    def final_norm(self, i: int) -> nn.Module:
        return self.norm


def _qwen3_5_head(config: dict[str, Any], num_layers: int, names: set[str]) -> MtpHead:
    from mlx_lm.models import qwen3_5

    text = dict(config.get("text_config") or config)
    args = qwen3_5.TextModelArgs.from_dict(text)
    head = QwenMtpHead(args, qwen3_5.DecoderLayer, num_layers)
    head.family = config.get("model_type", "qwen3_5")
    return head


def _qwen3_next_head(config: dict[str, Any], num_layers: int, names: set[str]) -> MtpHead:
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs.from_dict(config)
    head = QwenMtpHead(args, qwen3_next.Qwen3NextDecoderLayer, num_layers)
    head.family = "qwen3_next"
    return head


# ---------------------------------------------------------------------------------------
# DeepSeek-V3 / GLM-4.5+: enorm, hnorm, eh_proj and shared_head.norm live inside each
# nextn layer, next to a full decoder block of the family's class.


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


def nextn_layer_class(block_cls: type[nn.Module]) -> type[nn.Module]:
    """The family's decoder layer with the nextn projection and norms attached."""

    class NextnLayer(block_cls):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, layer_idx: int) -> None:
            super().__init__(args, layer_idx)
            h, eps = args.hidden_size, args.rms_norm_eps
            self.enorm = nn.RMSNorm(h, eps=eps)
            self.hnorm = nn.RMSNorm(h, eps=eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.shared_head = SharedHead(h, eps)

    NextnLayer.__name__ = f"Nextn{block_cls.__name__}"
    return NextnLayer


class NextnMtpHead(MtpHead):
    def __init__(self, args: Any, block_cls: type[nn.Module], num_layers: int) -> None:
        super().__init__()
        layer_cls = nextn_layer_class(block_cls)
        # Nextn layers follow the decoder stack, so their index makes them MoE layers.
        self.layers = [layer_cls(args, args.num_hidden_layers + i) for i in range(num_layers)]

    def norm_embedding(self, i: int) -> nn.Module:
        return self.layers[i].enorm

    def norm_hidden(self, i: int) -> nn.Module:
        return self.layers[i].hnorm

    def projection(self, i: int) -> nn.Module:
        return self.layers[i].eh_proj

    def final_norm(self, i: int) -> nn.Module:
        return self.layers[i].shared_head.norm


def _deepseek_v3_head(config: dict[str, Any], num_layers: int, names: set[str]) -> MtpHead:
    from mlx_lm.models import deepseek_v3

    args = deepseek_v3.ModelArgs.from_dict(config)
    head = NextnMtpHead(args, deepseek_v3.DeepseekV3DecoderLayer, num_layers)
    head.family = "deepseek_v3"
    head.mask_as_array = True
    return head


def _glm4_moe_head(config: dict[str, Any], num_layers: int, names: set[str]) -> MtpHead:
    from mlx_lm.models import glm4_moe

    args = glm4_moe.ModelArgs.from_dict(config)
    head = NextnMtpHead(args, glm4_moe.DecoderLayer, num_layers)
    head.family = "glm4_moe"
    return head


# ---------------------------------------------------------------------------------------
# MiMo: token_layernorm, hidden_layernorm, input_proj, final_layernorm around a Qwen2-style
# block; the hidden state comes first in the projection.


def mimo_layer_class(block_cls: type[nn.Module], proj_bias: bool) -> type[nn.Module]:
    class MimoMtpLayer(block_cls):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            h, eps = args.hidden_size, args.rms_norm_eps
            self.token_layernorm = nn.RMSNorm(h, eps=eps)
            self.hidden_layernorm = nn.RMSNorm(h, eps=eps)
            self.input_proj = nn.Linear(2 * h, h, bias=proj_bias)
            self.final_layernorm = nn.RMSNorm(h, eps=eps)

    return MimoMtpLayer


class MimoMtpHead(MtpHead):
    default_concat_order = HIDDEN_FIRST

    def __init__(self, args: Any, block_cls: type[nn.Module], num_layers: int, proj_bias: bool):
        super().__init__()
        layer_cls = mimo_layer_class(block_cls, proj_bias)
        self.layers = [layer_cls(args) for _ in range(num_layers)]

    def norm_embedding(self, i: int) -> nn.Module:
        return self.layers[i].token_layernorm

    def norm_hidden(self, i: int) -> nn.Module:
        return self.layers[i].hidden_layernorm

    def projection(self, i: int) -> nn.Module:
        return self.layers[i].input_proj

    def final_norm(self, i: int) -> nn.Module:
        return self.layers[i].final_layernorm


def _mimo_head(config: dict[str, Any], num_layers: int, names: set[str]) -> MtpHead:
    from mlx_lm.models import mimo

    args = mimo.ModelArgs.from_dict(config)
    proj_bias = any(n.endswith("input_proj.bias") for n in names)
    head = MimoMtpHead(args, mimo.TransformerBlock, num_layers, proj_bias)
    head.family = "mimo"
    return head


# ---------------------------------------------------------------------------------------
# Registry, keyed by family name (the `mtpkit.families` names and aliases).

HeadBuilder = Callable[[dict[str, Any], int, set[str]], MtpHead]

HEADS: dict[str, HeadBuilder] = {
    "qwen3_5": _qwen3_5_head,
    "qwen3_5_moe": _qwen3_5_head,
    "qwen3_next": _qwen3_next_head,
    "deepseek_v3": _deepseek_v3_head,
    "kimi_k2": _deepseek_v3_head,
    "glm4_moe": _glm4_moe_head,
    "mimo": _mimo_head,
}

# Where each family's head tensors may sit, in the order they are tried; the manifest's
# `prefix` wins when there is one.
HEAD_PREFIXES: dict[str, tuple[str, ...]] = {
    "qwen3_5": ("language_model.mtp.", "model.language_model.mtp.", "mtp."),
    "qwen3_next": ("mtp.", "model.mtp."),
    "nextn": ("mtp.",),
    "mimo": ("mtp.",),
}


def family_name(config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type not in HEADS and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type", model_type)
    return str(model_type)


def supported_families() -> list[str]:
    return sorted(HEADS)


def build_head(
    config: dict[str, Any], num_layers: int = 1, weight_names: Iterable[str] = ()
) -> MtpHead:
    """An MTP head with the family's layers, randomly initialised (load weights next)."""
    from mtpkit.errors import UnsupportedFamily

    name = family_name(config)
    builder = HEADS.get(name)
    if builder is None:
        raise UnsupportedFamily(
            f"no MTP head for model_type {name!r}; supported: {', '.join(supported_families())}"
        )
    return builder(config, num_layers, set(weight_names))


# ---------------------------------------------------------------------------------------
# Reading head weights from the layouts in the wild.

SIDECAR_FILES = ("mtp/weights.safetensors", "mtp.safetensors", "model-mtp.safetensors")
ZERO_CENTRED_FAMILIES = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
EXPERT_KEY = re.compile(
    r"^(?P<pre>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


@dataclass
class HeadWeights:
    """Head tensors under head-relative names, and what was done to them on the way in."""

    weights: dict[str, mx.array]
    layout: str  # "sidecar", "inline" or "raw_hf"
    prefix: str
    files: list[str]
    manifest: dict[str, Any] | None = None
    transforms: list[str] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        layers = {int(m.group(1)) for k in self.weights if (m := re.match(r"layers\.(\d+)\.", k))}
        return max(layers) + 1 if layers else 0


def _strip_prefix(names: Iterable[str], prefixes: Iterable[str]) -> str | None:
    names = list(names)
    for p in prefixes:
        if any(n.startswith(p) for n in names):
            return p
    return None


def _prefixes_for(family: str, manifest: dict[str, Any] | None) -> tuple[str, ...]:
    if manifest and manifest.get("prefix"):
        first: tuple[str, ...] = (str(manifest["prefix"]),)
    else:
        first = ()
    if family in ("qwen3_5", "qwen3_5_moe"):
        rest = HEAD_PREFIXES["qwen3_5"]
    elif family == "qwen3_next":
        rest = HEAD_PREFIXES["qwen3_next"]
    elif family == "mimo":
        rest = HEAD_PREFIXES["mimo"]
    else:
        rest = HEAD_PREFIXES["nextn"]
    return first + tuple(p for p in rest if p not in first)


def _raw_nextn_names(
    tensors: dict[str, mx.array], family: str, config: dict[str, Any]
) -> dict[str, mx.array]:
    """Raw DeepSeek/GLM (`model.layers.{N+i}.`) and MiMo (`model.mtp_layers.{i}.`) names."""
    text = config.get("text_config") or config
    out: dict[str, mx.array] = {}
    if family == "mimo":
        pat = re.compile(r"^model\.mtp_layers\.(\d+)\.(.*)$")
        for k, v in tensors.items():
            if m := pat.match(k):
                out[f"layers.{m.group(1)}.{m.group(2)}"] = v
        return out
    n = int(text["num_hidden_layers"])
    pat = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
    for k, v in tensors.items():
        if (m := pat.match(k)) and int(m.group(1)) >= n:
            rest = m.group(2)
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                continue  # copies of the backbone's embedding and lm_head
            out[f"layers.{int(m.group(1)) - n}.{rest}"] = v
    return out


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert (`experts.{e}.*_proj.weight`) and fused (`experts.gate_up_proj`) experts
    to mlx-lm's stacked `switch_mlp.*_proj.weight`; already stacked weights pass through."""
    out: dict[str, mx.array] = {}
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    for k, v in weights.items():
        if m := EXPERT_KEY.match(k):
            groups.setdefault((m["pre"], m["proj"]), {})[int(m["e"])] = v
        elif k.endswith(".experts.gate_up_proj"):
            pre = k.removesuffix(".experts.gate_up_proj")
            half = v.shape[1] // 2
            out[f"{pre}.switch_mlp.gate_proj.weight"] = v[:, :half]
            out[f"{pre}.switch_mlp.up_proj.weight"] = v[:, half:]
        elif k.endswith(".experts.down_proj"):
            out[k.removesuffix(".experts.down_proj") + ".switch_mlp.down_proj.weight"] = v
        else:
            out[k] = v
    for (pre, proj), experts in groups.items():
        stacked = mx.stack([experts[e] for e in sorted(experts)])
        out[f"{pre.removesuffix('.experts')}.switch_mlp.{proj}.weight"] = stacked
    return out


def shift_norms(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Zero-centred RMSNorm weights (the model applies 1 + w) to mlx gammas, in float32."""
    out = {}
    for k, v in weights.items():
        module = k.removesuffix(".weight").rsplit(".", 1)[-1]  # e.g. pre_fc_norm_embedding
        if v.ndim == 1 and k.endswith(".weight") and "norm" in module and "linear_attn" not in k:
            out[k] = (v.astype(mx.float32) + 1.0).astype(v.dtype)
        else:
            out[k] = v
    return out


def read_head_weights(model_dir: Path, config: dict[str, Any]) -> HeadWeights | None:
    """The head's tensors from a sidecar, the model shards (inline) or a raw HF checkpoint.

    Returns None when the directory holds no MTP tensors.
    """
    import json

    family = family_name(config)
    manifest_path = model_dir / "mtp" / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    prefixes = _prefixes_for(family, manifest)

    for rel in SIDECAR_FILES:
        path = model_dir / rel
        if path.exists():
            tensors = mx.load(str(path))
            prefix = _strip_prefix(tensors, prefixes) or ""
            weights = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            hw = HeadWeights(weights, "sidecar", prefix, [rel], manifest)
            if manifest and manifest.get("rmsnorm_weight_format") == "zero_centred":
                hw.weights = shift_norms(hw.weights)
                hw.transforms.append("shifted zero-centred norms by +1 (manifest)")
            hw.weights = stack_experts(hw.weights)
            return hw

    # Inline (community "-MTP" builds) or a raw HF checkpoint: look in the model shards.
    shards = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    head: dict[str, mx.array] = {}
    files: list[str] = []
    raw = "quantization" not in config and "quantization_config" not in config
    conv_raw = False
    prefix = None
    for shard in shards:
        tensors = mx.load(str(model_dir / shard))
        if any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in tensors.items()):
            conv_raw = True  # mlx-lm's own test for an unconverted Qwen3.5/Next checkpoint
        found = False
        p = _strip_prefix(tensors, prefixes)
        if p is not None:
            prefix = p
            for k, v in tensors.items():
                if k.startswith(p):
                    head[k[len(p) :]] = v
                    found = True
        elif family not in ZERO_CENTRED_FAMILIES:
            nextn = _raw_nextn_names(tensors, family, config)
            if nextn:
                head.update(nextn)
                prefix = "model.mtp_layers." if family == "mimo" else "model.layers.{N}."
                found = True
        if found:
            files.append(shard)
    if not head:
        return None
    # A raw HF checkpoint keeps zero-centred norms; converted (inline) ones are shifted.
    is_raw = family in ZERO_CENTRED_FAMILIES and (conv_raw or (raw and prefix == "mtp."))
    layout = "raw_hf" if is_raw or (prefix or "").startswith("model.") else "inline"
    hw = HeadWeights(head, layout, prefix or "", files, manifest)
    if is_raw:
        hw.weights = shift_norms(hw.weights)
        hw.transforms.append("shifted zero-centred norms by +1 (raw checkpoint)")
    hw.weights = stack_experts(hw.weights)
    return hw


def _quantization_predicate(
    weights: dict[str, mx.array], qconfig: dict[str, Any], prefix: str
) -> Callable[[str, nn.Module], bool | dict[str, Any]]:
    """Quantize exactly the layers whose weights carry scales, with bits and group size
    read from the shapes (what the tensors are), falling back on the config's entry."""

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        scales = weights.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            return False
        entry = qconfig.get(f"{prefix}{path}")
        params: dict[str, Any] = {}
        if isinstance(entry, dict):
            params.update({k: entry[k] for k in ("bits", "group_size", "mode") if k in entry})
        in_dims = module.weight.shape[-1]
        packed = weights[f"{path}.weight"].shape[-1]
        params.setdefault("group_size", in_dims // scales.shape[-1])
        params.setdefault("bits", packed * 32 // in_dims)
        if "mode" in qconfig:
            params.setdefault("mode", qconfig["mode"])
        return params

    return predicate


def load_head(
    model_dir: Path,
    config: dict[str, Any],
    *,
    norm_shift: float = 0.0,
    concat_order: str | None = None,
) -> tuple[MtpHead, HeadWeights] | None:
    """Build the family's head and load its weights strictly; None when there is no head.

    `norm_shift` adds a constant to every head RMSNorm weight and `concat_order` overrides
    the projection's input order: both exist to show what a wrong conversion does.
    """
    hw = read_head_weights(model_dir, config)
    if hw is None:
        return None
    num_layers = hw.num_layers or 1
    head = build_head(config, num_layers, hw.weights)
    if any(k.endswith(".scales") for k in hw.weights):
        qconfig = config.get("quantization") or config.get("quantization_config") or {}
        nn.quantize(
            head,
            group_size=int(qconfig.get("group_size", 64)),
            bits=int(qconfig.get("bits", 4)),
            class_predicate=_quantization_predicate(hw.weights, qconfig, hw.prefix),
        )
    head.load_weights(list(hw.weights.items()), strict=True)
    head.eval()
    order = concat_order or (hw.manifest or {}).get("concat_order")
    if order:
        head.set_concat_order(order)
    if norm_shift:
        for _, module in head.named_modules():
            if isinstance(module, nn.RMSNorm):
                module.weight = module.weight + norm_shift
    mx.eval(head.parameters())
    return head, hw
