"""The verify kernels on a CUDA GPU: correctness against float32 references, and their cost.

Run on the GPU machine (bench/gpu.sh stages MLX's CUDA build there); one call does it all:

    python3 bench/gpu_kernels.py [--shapes qwen3_5-0.8b,qwen3_5-4b,qwen3_5-9b] [--trials 21]
                                 [--out DIR] [--commit SHA]

1. gdn exactness: `kernels.gdn_verify_cuda` against a float32 numpy recurrence (y and the
   state after every position; max abs error), at each shape's layer sizes, T = 1..4, plus
   grouped heads and a padding mask.
2. gdn cost per layer, T = 1..4: mlx-lm's own T-token update (what a plain forward pays off
   Metal), today's verify (`gdn.stepwise_verify`) and the kernel; 20 chained calls per timing.
3. qmv exactness and cost for every distinct quantized matrix of each shape, rows 1..5
   (`--qmv-rows`; past 5 only the tensor-core variant, as a batch's verify takes it; at even
   rows from 4 MLX's also on the rows laid out [rows / 2, 2], a batch's verify at depth 1):
   `mx.quantized_matmul` against `qmv.multi_row_qmv`, both against a float32 dequantized
   reference (max abs error over the output's max magnitude), and their sums per forward.
4. The forward over T = 1..4 tokens at each shape (random 4-bit weights, group 64, bfloat16
   scales): stock mlx-lm, today's verify pass, verify with the gdn kernel, and with the gdn
   kernel and qmv. Costs are ratios to the stock 1-token forward of the same run.

Every timing is a median of interleaved trials (the order rotates each trial) with its
interquartile range. Tables go to stdout, everything to DIR/gpu_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

from mtpkit.runtime.kernels import gdn_verify as kernels  # noqa: E402
from mtpkit.runtime.kernels import qmv, routing  # noqa: E402
from mtpkit.runtime.rollback import gdn  # noqa: E402

# Qwen3.5 text configs (hidden size, MLP width, layers, heads); 3 linear-attention layers
# per full-attention layer, 248k vocabulary, as `mtpkit bench --random` builds them.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_5-0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2,
                         linear_num_value_heads=16, tie_word_embeddings=True),
    "qwen3_5-4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4,
                       linear_num_value_heads=32, tie_word_embeddings=True),
    "qwen3_5-9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4,
                       linear_num_value_heads=32, tie_word_embeddings=False),
}  # fmt: skip
COMMON = dict(model_type="qwen3_5_text", head_dim=256, linear_num_key_heads=16,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              full_attention_interval=4, rms_norm_eps=1e-6, vocab_size=248320,
              max_position_embeddings=262144,
              rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                               "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                               "rope_type": "default"})  # fmt: skip
DEPTHS = (1, 2, 3, 4)
REPS = 20  # calls per timing of one layer or matrix


# ---------------------------------------------------------------------------------------
# Timing.


def interleaved(variants: dict[str, Callable[[], Any]], trials: int) -> dict[str, dict]:
    """Median and quartiles (seconds) of each variant, the order rotating every trial."""
    for fn in variants.values():
        fn()  # warm up: JIT compiles, allocations
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for trial in range(trials):
        shift = trial % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        q = np.percentile(ts, [25, 50, 75])
        out[name] = {"median": float(q[1]), "q1": float(q[0]), "q3": float(q[2])}
    return out


def spread(stat: dict, unit: float) -> str:
    """'median (q1-q3)' in `unit`s."""
    return f"{stat['median'] / unit:.3g} ({stat['q1'] / unit:.3g}-{stat['q3'] / unit:.3g})"


# ---------------------------------------------------------------------------------------
# 1-2. The gated-delta-net verify.


def numpy_gated_delta(q, k, v, g, beta, state, mask=None):
    """Float32 numpy recurrence; returns y [B,T,Hv,Dv] and the state after every token."""
    f = np.float32
    q, k, v, g, beta = (np.array(t.astype(mx.float32), dtype=f) for t in (q, k, v, g, beta))
    s = np.array(state, dtype=f)
    rep = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, rep, axis=2), np.repeat(k, rep, axis=2)
    ys, states = [], []
    for t in range(q.shape[1]):
        if mask is None or bool(mask[0, t]):
            s = s * g[:, t, :, None, None]
            delta = (v[:, t] - np.einsum("bhvk,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
            s = s + np.einsum("bhv,bhk->bhvk", delta, k[:, t])
            ys.append(np.einsum("bhvk,bhk->bhv", s, q[:, t]))
        else:
            ys.append(np.zeros_like(v[:, t]))
        states.append(s.copy())
    return np.stack(ys, axis=1), states


def gdn_inputs(T: int, hk: int, hv: int, dk: int = 128, dv: int = 128, seed: int = 0):  # noqa: N803
    from mlx_lm.models.gated_delta import normalize_qk

    ks = mx.random.split(mx.random.key(seed), 8)
    dt = mx.bfloat16
    q = mx.random.normal((1, T, hk, dk), key=ks[0])
    k = mx.random.normal((1, T, hk, dk), key=ks[1])
    q, k = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, hv, dv), key=ks[2]).astype(dt)
    a = mx.random.normal((1, T, hv), key=ks[3]).astype(dt)
    b = mx.random.normal((1, T, hv), key=ks[4]).astype(dt)
    A_log = mx.random.uniform(0, 2, (hv,), key=ks[5])  # noqa: N806
    dt_bias = mx.random.normal((hv,), key=ks[6]).astype(dt)
    state = mx.random.normal((1, hv, dv, dk), key=ks[7]) * 0.1
    return q.astype(dt), k.astype(dt), v, a, b, A_log, dt_bias, state


def gdn_exactness(layer_heads: list[tuple[int, int]]) -> list[dict]:
    from mlx_lm.models.gated_delta import gated_delta_update

    rows = []
    cases = [(hk, hv, T, False) for hk, hv in layer_heads for T in DEPTHS]
    cases += [(layer_heads[0][0], layer_heads[0][1], 4, True)]
    for hk, hv, T, masked in cases:
        q, k, v, a, b, A_log, dt_bias, state = gdn_inputs(T, hk, hv)  # noqa: N806
        mask = mx.array([[True, False] + [True] * (T - 2)]) if masked else None
        y, states = kernels.gdn_verify_cuda(gated_delta_update, q, k, v, a, b, A_log, dt_bias,
                                            state, mask)  # fmt: skip
        g, beta = kernels.gates(a, b, A_log, dt_bias)
        ref_y, ref_states = numpy_gated_delta(q, k, v, g, beta, state,
                                              None if mask is None else np.array(mask))  # fmt: skip
        # A masked (padding) position's y is unused: mlx-lm's ops path computes it, its
        # Metal kernel and ours write zero; compare the kept positions only.
        on = np.ones(T, bool) if mask is None else np.array(mask)[0]
        y, ref_y = np.array(y.astype(mx.float32))[:, on], ref_y[:, on]
        row = {
            "hk": hk, "hv": hv, "T": T, "masked": masked,
            "y_err": float(np.abs(y - ref_y).max()), "y_max": float(np.abs(ref_y).max()),
            "state_err": max(float(np.abs(np.array(s) - r).max())
                             for s, r in zip(states, ref_states, strict=True)),
            "state_max": float(np.abs(ref_states[-1]).max()),
        }  # fmt: skip
        sy, sstates = gdn.stepwise_verify(gated_delta_update, q, k, v, a, b, A_log, dt_bias,
                                          state, mask)  # fmt: skip
        sy = np.array(sy.astype(mx.float32))[:, on]
        row["stepwise_y_err"] = float(np.abs(sy - ref_y).max())
        rows.append(row)
    return rows


def gdn_costs(hk: int, hv: int, trials: int) -> dict[int, dict]:
    return {T: interleaved(gdn_variants(T, hk, hv), trials) for T in DEPTHS}


def gdn_variants(T: int, hk: int, hv: int) -> dict[str, Callable[[], None]]:  # noqa: N803
    """REPS chained layer updates (each starts from the last one's state), per variant."""
    from mlx_lm.models.gated_delta import gated_delta_update

    q, k, v, a, b, A_log, dt_bias, state = gdn_inputs(T, hk, hv)  # noqa: N806
    steps = {
        "stock": lambda s: _as_list(gated_delta_update(q, k, v, a, b, A_log, dt_bias, s)),
        "stepwise": lambda s: gdn.stepwise_verify(gated_delta_update, q, k, v, a, b, A_log,
                                                  dt_bias, s, None),
        "kernel": lambda s: kernels.gdn_verify_cuda(gated_delta_update, q, k, v, a, b, A_log,
                                                    dt_bias, s, None),
    }  # fmt: skip

    def chained(step: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            s, keep = state, []
            for _ in range(REPS):
                y, states = step(s)
                s = states[-1]
                keep += [y, *states]
            mx.eval(keep)

        return run

    return {name: chained(step) for name, step in steps.items()}


def _as_list(result: tuple[mx.array, mx.array]) -> tuple[mx.array, list[mx.array]]:
    return result[0], [result[1]]


# ---------------------------------------------------------------------------------------
# 3. The multi-row quantized matmul.


def qmv_exactness_and_costs(n: int, k: int, trials: int, row_counts: list[int]) -> dict:
    ks = mx.random.split(mx.random.key(n * 7 + k), 2)
    w = (mx.random.normal((n, k), key=ks[0]) * k**-0.5).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    # float32 scales and biases: the weights s * q + b exactly (bf16 ones would round them)
    deq = mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=64,
                        bits=4)  # fmt: skip
    result: dict[str, Any] = {"n": n, "k": k, "err": {}, "time": {}}
    variants: dict[str, Callable[[], None]] = {}
    for rows in row_counts:
        x = mx.random.normal((1, rows, k), key=mx.random.key(rows)).astype(mx.bfloat16)
        ref = np.array(x.astype(mx.float32) @ deq.T)
        scale = float(np.abs(ref).max())

        def stock(x=x) -> mx.array:
            return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64,
                                       bits=4)  # fmt: skip

        variants[f"mlx{rows}"] = _repeated(stock)
        if rows >= 4 and rows % 2 == 0:  # a batch's verify at depth 1: [rows / 2, 2, K]

            def batched(x=x, rows=rows) -> mx.array:
                return mx.quantized_matmul(x.reshape(rows // 2, 2, k), wq, scales, biases,
                                           transpose=True, group_size=64, bits=4)  # fmt: skip

            variants[f"mlxb{rows}"] = _repeated(batched)
        errs = {"mlx": float(np.abs(np.array(stock().astype(mx.float32)) - ref).max()) / scale}
        if rows >= qmv.MIN_ROWS:
            for name, kwargs in QMV_VARIANTS.items():
                if (name == "mma" and not qmv.mma_shape_ok(
                    rows=rows, n=n, k=k, group_size=64, dtypes=(x.dtype, scales.dtype)
                )) or (name != "mma" and rows > qmv.MAX_ROWS):
                    continue

                def ours(x=x, kwargs=kwargs) -> mx.array:
                    return qmv.multi_row_qmv(x, wq, scales, biases, group_size=64, **kwargs)

                variants[f"qmv{rows}{name}"] = _repeated(ours)
                got = np.array(ours().astype(mx.float32))
                errs[f"qmv_{name}"] = float(np.abs(got - ref).max()) / scale
                errs[f"qmv_{name}_vs_mlx"] = float(
                    np.abs(got - np.array(stock().astype(mx.float32))).max()) / scale
        result["err"][rows] = errs
    result["time"] = interleaved(variants, trials)
    return result


QMV_VARIANTS = {"c1": {"columns": 1}, "c2": {"columns": 2}, "mma": {"variant": "mma"}}


def _repeated(fn: Callable[[], mx.array]) -> Callable[[], None]:
    def run() -> None:
        mx.eval([fn() for _ in range(REPS)])

    return run


def matrices(model: nn.Module) -> dict[tuple[int, int], int]:
    """Distinct (out, in) sizes of the quantized layers one forward multiplies, with counts."""
    counts: dict[tuple[int, int], int] = {}
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding):
            if isinstance(m, nn.QuantizedEmbedding) and not model.language_model.args.tie_word_embeddings:
                continue  # the untied embedding is a lookup, not a matmul
            n, k = m["weight"].shape[0], m["weight"].shape[1] * 32 // m.bits
            counts[(n, k)] = counts.get((n, k), 0) + 1
    return counts


# ---------------------------------------------------------------------------------------
# 4. The forward at real shapes.


def build_model(shape: str) -> nn.Module:
    """Random 4-bit Qwen3.5 text model of `shape`, bfloat16 (so bfloat16 scales), group 64."""
    from mlx_lm.models import qwen3_5

    text = {**COMMON, **SHAPES[shape]}
    config = {"model_type": "qwen3_5", "text_config": text,
              "tie_word_embeddings": text["tie_word_embeddings"]}  # fmt: skip
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % 64 == 0)  # fmt: skip
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


class Forwards:
    """Forwards of T tokens at a fixed cache position (prompt of 64 tokens), each undone."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.cache = model.make_cache()
        model(mx.arange(64)[None] % 1000, cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.saved = [list(c.cache) if gdn.is_recurrent_cache(c) else None for c in self.cache]

    def run(self, T: int, *, verify: bool, kernel: bool, rows_kernel: bool) -> None:  # noqa: N803
        tokens = mx.full((1, T), 7, dtype=mx.int32)
        snapshots = gdn.GdnSnapshots() if verify else None
        previous = gdn.set_gdn_verify_impl(kernels.gdn_verify_cuda if kernel
                                           else gdn.stepwise_verify)  # fmt: skip
        try:
            with gdn.capture_gdn_states(snapshots):
                if rows_kernel:
                    with routing.multi_row_matmuls(self.model):
                        logits = self.model(tokens, cache=self.cache)
                else:
                    logits = self.model(tokens, cache=self.cache)
            mx.eval(logits, snapshots.states if snapshots else [])
        finally:
            gdn.set_gdn_verify_impl(previous)
        for c, saved in zip(self.cache, self.saved, strict=True):
            if saved is None:
                c.trim(T)
            else:
                c.cache = list(saved)


def forward_costs(model: nn.Module, trials: int) -> dict[str, dict]:
    gdn.tap_gated_delta_layers(model)
    routing.route_quantized_layers(model, measure=False)  # every matrix it can take
    f = Forwards(model)
    variants = {"stock T=1": lambda: f.run(1, verify=False, kernel=False, rows_kernel=False)}
    for T in DEPTHS[1:]:  # noqa: N806
        variants[f"stock T={T}"] = lambda T=T: f.run(T, verify=False, kernel=False,
                                                     rows_kernel=False)  # fmt: skip
        variants[f"verify T={T}"] = lambda T=T: f.run(T, verify=True, kernel=False,
                                                      rows_kernel=False)  # fmt: skip
        variants[f"+gdn T={T}"] = lambda T=T: f.run(T, verify=True, kernel=True,
                                                    rows_kernel=False)  # fmt: skip
        variants[f"+gdn+qmv T={T}"] = lambda T=T: f.run(T, verify=True, kernel=True,
                                                        rows_kernel=True)  # fmt: skip
    return interleaved(variants, trials)


# ---------------------------------------------------------------------------------------
# Driver.


def section(name: str, results: dict, fn: Callable[[], Any]) -> Any:
    print(f"\n== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception:  # a bench reports what broke and goes on with the next section
        results.setdefault("errors", {})[name] = traceback.format_exc()
        print(traceback.format_exc(), flush=True)
        return None
    results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
    return value


def print_gdn_exactness(rows: list[dict]) -> None:
    print("hk hv T mask | y max err (of |y| max) | state max err (of max) | stepwise y err")
    for r in rows:
        print(f"{r['hk']:2} {r['hv']:2} {r['T']} {'y' if r['masked'] else 'n'}    | "
              f"{r['y_err']:.2e} ({r['y_max']:.2f}) | {r['state_err']:.2e} "
              f"({r['state_max']:.2f}) | {r['stepwise_y_err']:.2e}")  # fmt: skip


def print_gdn_costs(costs: dict[int, dict]) -> None:
    one = costs[1]["stock"]["median"]
    print("T | per layer us: stock | stepwise verify | kernel   (ratio to stock T=1)")
    for T, c in costs.items():  # noqa: N806
        cells = [f"{spread(c[v], REPS * 1e-6)} [{c[v]['median'] / one:.2f}]"
                 for v in ("stock", "stepwise", "kernel")]  # fmt: skip
        print(f"{T} | " + " | ".join(cells))


def print_qmv(results: list[dict], counts: dict[tuple[int, int], int], row_counts: list[int]) -> dict:
    """Per matrix: microseconds per call by rows (mlx (b: MLX's on the rows laid out
    [rows / 2, 2], as a batch's verify at depth 1 gives them) -> fma c1 / fma c2 / mma), the
    errors at 3 rows; then the sums over one forward's matrices."""
    print("N x K (count) | rows: mlx us -> qmv c1 / c2 / mma us | max err/|ref|max at 3 rows:"
          " mlx, c1, mma")  # fmt: skip
    totals: dict[str, float] = {}

    def add(key: str, us: float, count: int) -> None:
        totals[key] = totals.get(key, 0.0) + count * us

    for r in results:
        t, count = r["time"], counts[(r["n"], r["k"])]
        cells = []
        for rows in row_counts:
            mlx_us = t[f"mlx{rows}"]["median"] / REPS * 1e6
            add(f"mlx{rows}", mlx_us, count)
            if rows == 1:
                cells.append(f"1: {mlx_us:.1f}")
                continue
            ours = {v: t[f"qmv{rows}{v}"]["median"] / REPS * 1e6 if f"qmv{rows}{v}" in t
                    else mlx_us for v in QMV_VARIANTS}  # fmt: skip (n/a: counted as mlx)
            for v, us in ours.items():
                add(f"{v}{rows}", us, count)
            add(f"best{rows}", min(mlx_us, *ours.values()), count)
            laid = ""
            if f"mlxb{rows}" in t:  # MLX's on the rows laid out [rows / 2, 2]
                batched_us = t[f"mlxb{rows}"]["median"] / REPS * 1e6
                add(f"mlxb{rows}", batched_us, count)
                laid = f" (b {batched_us:.1f})"
            cells.append(f"{rows}: {mlx_us:.1f}{laid}->"
                         + "/".join(f"{us:.1f}" for us in ours.values()))  # fmt: skip
        e = r["err"][3 if 3 in r["err"] else max(r["err"])]
        print(f"{r['n']}x{r['k']} ({count}) | " + "  ".join(cells)
              + f" | {e['mlx']:.1e}, {e.get('qmv_c1', float('nan')):.1e},"
              f" {e.get('qmv_mma', float('nan')):.1e}")  # fmt: skip
    for key in ("mlx", "mlxb", *QMV_VARIANTS, "best"):
        line = "  ".join(f"{rows}: {totals[f'{key}{rows}']:.0f}"
                         for rows in row_counts if f"{key}{rows}" in totals)  # fmt: skip
        print(f"sum per forward, us, {key:>4}: {line}")
    return totals


def print_forward(costs: dict[str, dict]) -> None:
    one = costs["stock T=1"]["median"]
    print(f"stock 1-token forward: {spread(costs['stock T=1'], 1e-3)} ms")
    print("T | stock | verify (today) | +gdn kernel | +gdn+qmv    (ratio to stock T=1, IQR)")
    for T in DEPTHS[1:]:  # noqa: N806
        cells = []
        for v in ("stock", "verify", "+gdn", "+gdn+qmv"):
            c = costs[f"{v} T={T}"]
            cells.append(f"{c['median'] / one:.2f} ({c['q1'] / one:.2f}-{c['q3'] / one:.2f})")
        print(f"{T} | " + " | ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--trials", type=int, default=21)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    parser.add_argument("--commit", default=os.environ.get("MTPKIT_COMMIT", "unknown"))
    parser.add_argument("--skip", default="", help="sections to skip: gdn,qmv,forward")
    parser.add_argument("--qmv-rows", default="1,2,3,4,5",
                        help="rows of the qmv section (past 5: the tensor-core variant only; "
                        "a batch's verify gives batch x (depth + 1))")
    args = parser.parse_args()
    shapes, skip = args.shapes.split(","), set(args.skip.split(","))
    row_counts = [int(r) for r in args.qmv_rows.split(",")]
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "commit": args.commit, "mlx": mx.__version__,
        "device": mx.device_info().get("device_name", platform.processor()),
        "cuda": kernels.cuda_available(), "trials": args.trials, "shapes": {},
    }  # fmt: skip
    print(f"{results['date']} {results['device']} mlx {results['mlx']} commit {args.commit}")
    if not results["cuda"]:
        print("no CUDA GPU: nothing to measure")
        return 1
    heads = sorted({(16, SHAPES[s]["linear_num_value_heads"]) for s in shapes})
    if "gdn" not in skip:
        rows = section("gdn exactness", results, lambda: gdn_exactness(heads))
        if rows:
            results["gdn_exactness"] = rows
            print_gdn_exactness(rows)
        for hk, hv in heads:
            costs = section(f"gdn per layer hk={hk} hv={hv}", results,
                            lambda hk=hk, hv=hv: gdn_costs(hk, hv, args.trials))  # fmt: skip
            if costs:
                results[f"gdn_costs_{hk}_{hv}"] = costs
                print_gdn_costs(costs)
    for shape in shapes:
        model = section(f"build {shape}", results, lambda shape=shape: build_model(shape))
        if model is None:
            continue
        entry = results["shapes"].setdefault(shape, {})
        counts = matrices(model)
        if "qmv" not in skip:
            mats = section(f"qmv {shape}", results, lambda counts=counts: [
                qmv_exactness_and_costs(n, k, args.trials, row_counts) for n, k in sorted(counts)])
            if mats:
                entry["qmv"] = mats
                entry["qmv_totals_us"] = print_qmv(mats, counts, row_counts)
        if "forward" not in skip:
            costs = section(f"forward {shape}", results,
                            lambda model=model: forward_costs(model, args.trials))  # fmt: skip
            if costs:
                entry["forward"] = costs
                print_forward(costs)
        del model
        mx.clear_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\nsection seconds: {results.get('section_seconds')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
