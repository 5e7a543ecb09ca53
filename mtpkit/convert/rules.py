"""The family-independent tensor rules of mlx-lm's `sanitize`, as pure functions on names
and arrays: stack experts (per-expert and fused), split fused experts, dequantize FP8,
move conv1d to MLX's layout, shift zero-centred norms by +1.

Conversion streams tensors through `TensorRules` (experts arrive one at a time and are
buffered per layer); loading a head from a file that was never converted uses the dict
versions `stack_experts` and `shift_norms`. Every rule keys on names and shapes, so its
output passes through it unchanged: converting twice is a no-op.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mtpkit.convert.quant import QuantSpec, quantize
from mtpkit.convert.reader import Ref, ThreadLoads
from mtpkit.core.errors import MtpkitError
from mtpkit.families import Family

FP8_DTYPES = ("F8_E4M3",)
# Experts as checkpoints store them: one tensor per expert and projection, or all experts
# of a layer fused into `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I].
PER_EXPERT = re.compile(
    r"^(?P<mlp>.*)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
    r"\.(?P<part>weight|scales|biases)$"
)
FUSED_GATE_UP = re.compile(r"^(?P<mlp>.*)\.experts\.gate_up_proj(?:\.weight)?$")
FUSED_DOWN = re.compile(r"^(?P<mlp>.*)\.experts\.down_proj(?:\.weight)?$")

Outputs = list[tuple[str, mx.array]]


# --------------------------------------------------------------------------- array rules


def dequant_fp8(weight: mx.array, scale_inv: mx.array) -> mx.array:
    """Block-128 FP8 to bfloat16, exactly as mlx-lm's deepseek_v3 sanitize computes it."""
    weight = mx.from_fp8(weight, dtype=mx.bfloat16)
    bs = 128
    m, n = weight.shape
    pad_bottom, pad_side = (-m) % bs, (-n) % bs
    weight = mx.pad(weight, ((0, pad_bottom), (0, pad_side)))
    weight = weight.reshape(((m + pad_bottom) // bs, bs, (n + pad_side) // bs, bs))
    weight = (weight * scale_inv[:, None, :, None]).reshape(m + pad_bottom, n + pad_side)
    return weight[:m, :n].astype(mx.bfloat16)


def split_gate_up(fused: mx.array) -> tuple[mx.array, mx.array]:
    """Fused experts' `gate_up_proj` [E, 2I, H] as gate [E, I, H] and up [E, I, H]."""
    mid = fused.shape[-2] // 2
    return fused[..., :mid, :], fused[..., mid:, :]


def is_raw_conv1d(shape: Iterable[int]) -> bool:
    """A depthwise conv1d weight in Hugging Face's [C, 1, K] layout (mlx-lm's own test)."""
    return tuple(shape)[-1] != 1


def conv1d_to_mlx(name: str, array: mx.array) -> mx.array:
    """HF Conv1d [C, 1, K] -> MLX [C, K, 1]; an MLX-layout weight passes unchanged."""
    if name.endswith("conv1d.weight") and array.ndim == 3 and is_raw_conv1d(array.shape):
        return array.moveaxis(2, 1)
    return array


def is_norm_to_shift(name: str, array: mx.array, norm_keys_or_suffixes: tuple[str, ...]) -> bool:
    """A 1-D weight named by (or ending with one of) `norm_keys_or_suffixes`."""
    return array.ndim == 1 and name.endswith(norm_keys_or_suffixes)


def shift_norm(array: mx.array, dtype: mx.Dtype | None = None) -> mx.array:
    """A zero-centred RMSNorm weight (the model applies 1 + w) as mlx-lm's gamma: +1 in
    float32, then one rounding to `dtype` (the array's own by default; MTP_FORMATS.md)."""
    return (array.astype(mx.float32) + 1.0).astype(dtype or array.dtype)


def stack_experts(
    weights: dict[str, mx.array], projections: dict[str, str] | None = None
) -> dict[str, mx.array]:
    """Per-expert (`experts.{e}.*_proj.{weight,scales,biases}`) and fused
    (`experts.gate_up_proj`, `experts.down_proj`) experts to mlx-lm's stacked
    `switch_mlp.*_proj.*` (a per-expert projection renamed by `projections`, a family's
    `expert_projections`); already stacked weights and every other tensor pass through."""
    projections = projections or {}
    out: dict[str, mx.array] = {}
    groups: dict[str, dict[int, mx.array]] = {}
    for name, array in weights.items():
        if m := PER_EXPERT.match(name):
            proj = projections.get(m["proj"], m["proj"])
            key = f"{m['mlp']}.switch_mlp.{proj}.{m['part']}"
            groups.setdefault(key, {})[int(m["expert"])] = array
        elif m := FUSED_GATE_UP.match(name):
            gate, up = split_gate_up(array)
            out[f"{m['mlp']}.switch_mlp.gate_proj.weight"] = gate
            out[f"{m['mlp']}.switch_mlp.up_proj.weight"] = up
        elif m := FUSED_DOWN.match(name):
            out[f"{m['mlp']}.switch_mlp.down_proj.weight"] = array
        else:
            out[name] = array
    for key, experts in groups.items():
        out[key] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def shift_norms(
    weights: dict[str, mx.array], norm_keys_or_suffixes: Iterable[str]
) -> dict[str, mx.array]:
    """Zero-centred RMSNorm weights to mlx gammas (+1 in float32, back to their dtype).

    Shifted are the 1-D tensors whose name is, or ends with, one of `norm_keys_or_suffixes`
    (a family's `head_norm_suffixes`, say); every other tensor passes through.
    """
    suffixes = tuple(norm_keys_or_suffixes)
    return {
        name: shift_norm(array) if is_norm_to_shift(name, array, suffixes) else array
        for name, array in weights.items()
    }


# --------------------------------------------------------------------------- streamed rules


@dataclass
class Tensor:
    """One output tensor before cast/quantization: its role, name, lazy value and state."""

    role: str  # "backbone" or "head"
    name: str
    array: mx.array
    shift: bool = False


@dataclass
class Item:
    """Source tensors and how they become named outputs (computed only when called).

    Every source tensor feeds exactly one Item, so a worker can load, compute, write and
    release it on its own.
    """

    refs: list[Ref]
    names: list[str]
    fn: Callable[[list[mx.array]], Outputs]


@dataclass(frozen=True)
class Finish:
    """What the plan decided for one output tensor after the rules: the dtype to cast to
    (None: its own) and the quantization (None: stored as is)."""

    dtype: mx.Dtype | None = None
    quant: QuantSpec | None = None


@dataclass
class Job:
    """A recipe for some output tensors: the source tensors it reads, how, and what the plan
    decided for each output (`finishes`, by tensor name)."""

    role: str
    refs: list[Ref]
    make: Callable[[list[mx.array]], list[Tensor]]
    entry_names: list[str] = field(default_factory=list)
    nbytes: int = 0  # output bytes
    source_bytes: int = 0
    finishes: dict[str, Finish] = field(default_factory=dict)

    def outputs(self, arrays: list[mx.array]) -> Outputs:
        """The job's output entries from its source arrays (lazy), as the plan decided."""
        return [e for t in self.make(arrays) for e in finish(t, self.finishes.get(t.name))]


def finish(t: Tensor, decided: Finish | None) -> Outputs:
    """Cast (shifting a zero-centred norm +1 first) and quantize one tensor."""
    decided = decided or Finish()
    array = t.array
    target = decided.dtype or array.dtype
    if t.shift:
        array = shift_norm(array, target)
    elif array.dtype != target:
        array = array.astype(target)
    if decided.quant is None:
        return [(t.name, array)]
    path = t.name.removesuffix(".weight")
    # weight and scales, plus biases in affine mode (mlx-lm's `to_quantized` outputs).
    return [(f"{path}.{k}", v) for k, v in quantize(array, decided.quant).items()]


def job_computer() -> Callable[[Job], Outputs]:
    """What the writer's threads call: a job's outputs from its source tensors, each thread
    reading the files itself. Nothing of the planner is kept."""
    loads = ThreadLoads()
    return lambda job: job.outputs(loads.arrays(job.refs))


def _leaf(ref: Ref, name: str) -> Item:
    return Item([ref], [name], lambda arrays: [(name, arrays[0])])


def _derive(item: Item, names: list[str], fn: Callable[[mx.array], Outputs]) -> Item:
    """An Item whose single output is transformed by `fn` into `names`."""
    inner = item.fn
    return Item(item.refs, names, lambda arrays: fn(inner(arrays)[0][1]))


def _stack(items: list[Item], name: str) -> Item:
    refs = [r for it in items for r in it.refs]
    sizes = [len(it.refs) for it in items]
    fns = [it.fn for it in items]

    def fn(arrays: list[mx.array]) -> Outputs:
        parts, at = [], 0
        for f, n in zip(fns, sizes, strict=True):
            parts.append(f(arrays[at : at + n])[0][1])
            at += n
        return [(name, mx.stack(parts))]

    return Item(refs, [name], fn)


def _named_split(gate: str, up: str) -> Callable[[mx.array], Outputs]:
    def split(fused: mx.array) -> Outputs:
        gate_part, up_part = split_gate_up(fused)
        return [(gate, gate_part), (up, up_part)]

    return split


class TensorRules:
    """The rules above, applied per source tensor as a generator of Jobs.

    Experts arrive one tensor at a time and are buffered per layer until every expert is
    there; FP8 weights wait for their `weight_scale_inv`. What is still buffered at the end
    is reported, never dropped. Rules build Jobs (recipes over source tensors), not arrays,
    so that any worker thread can run them.
    """

    def __init__(self, family: Family, *, shift_backbone: bool, shift_head: bool) -> None:
        self.family = family
        self.shift = {"backbone": shift_backbone, "head": shift_head}
        self.experts: dict[tuple[str, str], dict[int, Item]] = {}
        self.fp8: dict[str, dict[str, Ref]] = {}

    def feed(self, role: str, name: str, ref: Ref, src_dtype: str) -> Iterator[Job]:
        # FP8 block-quantized weights (DeepSeek): dequantize as mlx-lm's sanitize does.
        if name.endswith(".weight_scale_inv") or src_dtype in FP8_DTYPES:
            key = name.removesuffix("_scale_inv")
            slot = self.fp8.setdefault(key, {})
            slot["scale" if name.endswith("_scale_inv") else "weight"] = ref
            if "scale" in slot and "weight" in slot:
                del self.fp8[key]
                item = Item(
                    [slot["weight"], slot["scale"]],
                    [key],
                    lambda arrays, key=key: [(key, dequant_fp8(arrays[0], arrays[1]))],
                )
                yield from self._split(role, item)
            return
        yield from self._split(role, _leaf(ref, name))

    def _split(self, role: str, item: Item) -> Iterator[Job]:
        parts = self.family.split_tensor(item.names[0])
        if parts is None:
            yield from self._experts(role, item)
            return
        names = [n for n, _ in parts]
        fns = [f for _, f in parts]
        item = _derive(
            item,
            names,
            lambda a, names=names, fns=fns: [(n, f(a)) for n, f in zip(names, fns, strict=True)],
        )
        yield self._job(role, item)

    def _experts(self, role: str, item: Item) -> Iterator[Job]:
        name = item.names[0]
        if m := PER_EXPERT.match(name):
            proj = self.family.expert_projections.get(m["proj"], m["proj"])
            key = (f"{m['mlp']}.switch_mlp.{proj}.{m['part']}", role)
            slot = self.experts.setdefault(key, {})
            expert = int(m["expert"])
            if expert in slot:
                raise MtpkitError(f"{name} appears twice in the checkpoint")
            slot[expert] = item
            if len(slot) == self.family.num_experts:
                del self.experts[key]
                yield self._job(role, _stack([slot[e] for e in sorted(slot)], key[0]))
        elif m := FUSED_GATE_UP.match(name):
            gate = f"{m['mlp']}.switch_mlp.gate_proj.weight"
            up = f"{m['mlp']}.switch_mlp.up_proj.weight"
            yield self._job(role, _derive(item, [gate, up], _named_split(gate, up)))
        elif m := FUSED_DOWN.match(name):
            down = f"{m['mlp']}.switch_mlp.down_proj.weight"
            yield self._job(role, _derive(item, [down], lambda a, down=down: [(down, a)]))
        else:
            yield self._job(role, item)

    def _job(self, role: str, item: Item) -> Job:
        fn = item.fn
        return Job(role, item.refs, lambda arrays: [self._final(role, n, a) for n, a in fn(arrays)])

    def _final(self, role: str, name: str, array: mx.array) -> Tensor:
        if self.family.has_conv1d:
            array = conv1d_to_mlx(name, array)
        suffixes = (
            self.family.backbone_norm_suffixes
            if role == "backbone"
            else self.family.head_norm_suffixes
        )
        shift = self.shift[role] and is_norm_to_shift(name, array, suffixes)
        return Tensor(role, name, array, shift=shift)

    def leftovers(self) -> list[str]:
        left = [
            f"{name}: experts {sorted(slot)} of {self.family.num_experts}"
            for (name, _), slot in self.experts.items()
        ]
        left += [
            f"{name}: FP8 weight without its scale (or scale without weight)" for name in self.fp8
        ]
        return left
