"""`mtpkit bench`: plain decoding against MTP decoding at depths 1..K, in one run.

Plain decoding is stock `mlx_lm.stream_generate` on a separately loaded, untouched copy of
the same directory. Next to the realized speedups it reports the two costs that bound them:

- beta: a 2-token verify forward (with mtpkit's gated-delta-net snapshots, as decoding runs
  it) over a 1-token forward;
- delta: one head step (projection, block, final norm, lm_head) over a 1-token forward;

and the ceiling (1 + a) / (beta + delta) at depth 1, generalised for depth K to
E_K / (beta_K + K delta), where E_K = 1 + a_1 + a_1 a_2 + ... is the expected number of
tokens per round from the per-depth acceptance and beta_K the (K+1)-token verify cost.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.decode import MtpDecoder, SamplingSettings
from mtpkit.errors import MtpkitError
from mtpkit.generate import check_prompt, encode_prompt
from mtpkit.runtime import (
    MtpModel,
    NoMtpHead,
    is_recurrent_cache,
    library_io,
    load_model,
    untapped,
)
from mtpkit.upcast import upcast_experts

DEFAULT_PROMPT = (
    "Write a short explanation of how a hash table works, with an example of inserting "
    "and looking up keys, and the cost of each operation."
)


@dataclass
class BenchRun:
    depth: int
    acceptance: float | None
    decode_tps: float
    speedup: float
    ceiling: float | None
    acceptance_by_depth: list[float | None] = field(default_factory=list)


@dataclass
class BenchResult:
    model: str
    plain_tps: float
    beta: float
    delta: float
    runs: list[BenchRun]
    verify_costs: dict[int, float]
    no_mtp_tps: float
    prompt_tokens: int
    max_tokens: int
    moe_dtype: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "plain_tps": self.plain_tps,
            "beta": self.beta,
            "delta": self.delta,
            "moe_dtype": self.moe_dtype,
            "runs": [
                {
                    "depth": r.depth,
                    "acceptance": r.acceptance,
                    "decode_tps": r.decode_tps,
                    "speedup": r.speedup,
                    "ceiling": r.ceiling,
                }
                for r in self.runs
            ],
        }


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _ForwardTimer:
    """Times backbone forwards of n tokens at a fixed cache position, undoing each one."""

    def __init__(self, m: MtpModel, prompt: list[int]) -> None:
        self.m = m
        self.cache = m.make_cache()
        m.model(mx.array(prompt)[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.saved = [list(c.cache) if is_recurrent_cache(c) else None for c in self.cache]
        self.token = prompt[-1]

    def forward(self, n: int) -> None:
        tokens = mx.array([self.token] * n)
        if n > 1:  # a verify pass, with its gated-delta-net snapshots, as decoding runs it
            verified = self.m.verify(tokens, self.cache)
            snapshots = verified.snapshots.states if verified.snapshots else []
            mx.eval(verified.logits, verified.hidden, snapshots)
        else:
            mx.eval(*self.m.forward(tokens[None], self.cache))
        for c, saved in zip(self.cache, self.saved, strict=True):
            if saved is None:
                c.trim(n)
            else:
                c.cache = list(saved)


def measure_costs(
    m: MtpModel, prompt: list[int], *, max_depth: int, repeats: int = 20
) -> tuple[dict[int, float], float, float]:
    """Seconds of a 1-token forward, and verify costs {K: t(K+1 tokens)/t(1)}, and delta."""
    timer = _ForwardTimer(m, prompt)
    one = _median_time(lambda: timer.forward(1), repeats)
    verify = {
        k: _median_time(lambda k=k: timer.forward(k + 1), repeats) / one
        for k in range(1, max_depth + 1)
    }
    delta = 0.0
    if m.head is not None:
        head = m.head
        token = mx.array([[prompt[-1]]])
        dtype = m.embed(token).dtype
        h = mx.random.normal((1, 1, _hidden_size(m))).astype(dtype)
        cache = head.make_cache()
        warm = head(mx.repeat(h, len(prompt), axis=1), m.embed(mx.array(prompt)[None]), cache)
        mx.eval(warm)

        def head_step() -> None:
            x = head(h, m.embed(token), cache)
            logits = m.lm_head(head.final_norm(0)(x))
            mx.eval(mx.argmax(logits, axis=-1))
            for c in cache:
                c.trim(1)

        delta = _median_time(head_step, repeats) / one
    return verify, delta, one


def _hidden_size(m: MtpModel) -> int:
    text = m.config.get("text_config") or m.config
    return int(text["hidden_size"])


def _stock_run(model: nn.Module, tokenizer: Any, prompt: list[int], max_tokens: int) -> float:
    """Decode tok/s of stock mlx-lm's `stream_generate` (its own `generation_tps`)."""
    import mlx_lm

    last = None
    for response in mlx_lm.stream_generate(
        model, tokenizer, mx.array(prompt), max_tokens=max_tokens
    ):
        last = response
    return float(last.generation_tps) if last is not None else 0.0


def _mtp_run(
    m: MtpModel, prompt: list[int], depth: int, max_tokens: int
) -> tuple[float, MtpDecoder]:
    """Decode tok/s over rounds 2..end (the first round's tokens arrive with the prompt's
    cost, as the first token does in mlx-lm's figure), and the decoder with its stats."""
    decoder = MtpDecoder(m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=False)
    n = first_round = 0
    t0 = None
    for _ in decoder.tokens(max_tokens):
        n += 1
        steps = decoder.stats.rounds + decoder.stats.plain_steps
        if t0 is None:
            t0, first_steps = time.perf_counter(), steps
        if steps == first_steps:
            first_round += 1
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    tps = (n - first_round) / elapsed if n > first_round and elapsed > 0 else 0.0
    return tps, decoder


def ceiling(
    acceptance_by_depth: list[float | None], verify_cost: float, delta: float
) -> float | None:
    expected = 1.0
    running = 1.0
    for a in acceptance_by_depth:
        running *= a or 0.0
        expected += running
    cost = verify_cost + len(acceptance_by_depth) * delta
    return expected / cost if cost > 0 else None


def bench(
    model: str | Path,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 128,
    max_depth: int = 3,
    chat_template: bool = True,
    repeats: int = 20,
    trials: int = 3,
    progress: Callable[[str], None] | None = None,
) -> BenchResult:
    """Measure plain decoding against MTP decoding at depths 1..max_depth; `progress` gets a
    line per stage and per measured run."""
    if trials < 1 or max_tokens < 1:
        raise MtpkitError(f"trials and max_tokens must be at least 1, not {trials}, {max_tokens}")
    say = progress or (lambda s: None)
    m = load_model(model)
    if m.head is None:
        raise NoMtpHead(f"{m.path} has no MTP head: run `mtpkit inspect` and `mtpkit convert`")
    eos = m.tokenizer.eos_token_ids
    m.tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    try:
        return _bench(m, model, prompt, max_tokens, max_depth, chat_template, repeats, say, trials)
    finally:
        m.tokenizer.eos_token_ids = eos


def _bench(
    m: MtpModel,
    model: str | Path,
    prompt: str,
    max_tokens: int,
    max_depth: int,
    chat_template: bool,
    repeats: int,
    say: Callable[[str], None],
    trials: int,
) -> BenchResult:
    import mlx_lm

    tokens = encode_prompt(m, prompt, chat_template=chat_template)
    check_prompt(m, tokens)
    say("forward and head costs")
    verify, delta, _ = measure_costs(m, tokens, max_depth=max_depth, repeats=repeats)
    # Stock mlx-lm on its own, untouched load of the directory.
    with library_io():  # never remote code, never a question on stdin
        stock_model, stock_tokenizer = mlx_lm.load(
            str(m.path), tokenizer_config={"trust_remote_code": False}
        )
    upcast_experts([stock_model], what=str(m.path))  # as mtpkit's own load does (CPU only)
    stock_tokenizer.eos_token_ids = []  # every run decodes exactly max_tokens tokens
    _stock_run(stock_model, stock_tokenizer, tokens, 8)  # warm up
    _mtp_run(m, tokens, 1, 8)
    # Trials interleave every configuration, and each figure is its best trial: the one
    # least disturbed by other work on the machine.
    plain = no_mtp = 0.0
    best: dict[int, tuple[float, MtpDecoder]] = {}
    for trial in range(trials):
        at = f"trial {trial + 1}/{trials}:"
        tps = _stock_run(stock_model, stock_tokenizer, tokens, max_tokens)
        say(f"{at} stock mlx-lm {tps:.1f} tok/s")
        plain = max(plain, tps)
        with untapped(m.final_norm):
            tps = _stock_run(m.model, m.tokenizer, tokens, max_tokens)
        say(f"{at} mtpkit --no-mtp {tps:.1f} tok/s")
        no_mtp = max(no_mtp, tps)
        for depth in range(1, max_depth + 1):
            run = _mtp_run(m, tokens, depth, max_tokens)
            acceptance = run[1].stats.acceptance
            accepted = "n/a" if acceptance is None else f"{acceptance:.1%}"
            say(f"{at} MTP depth {depth} {run[0]:.1f} tok/s, acceptance {accepted}")
            if depth not in best or run[0] > best[depth][0]:
                best[depth] = run
    del stock_model
    runs = []
    for depth in range(1, max_depth + 1):
        tps, decoder = best[depth]
        by_depth = decoder.stats.acceptance_by_depth(depth)
        runs.append(
            BenchRun(
                depth=depth,
                acceptance=decoder.stats.acceptance,
                decode_tps=tps,
                speedup=tps / plain if plain else 0.0,
                ceiling=ceiling(by_depth, verify[depth], delta),
                acceptance_by_depth=by_depth,
            )
        )
    return BenchResult(
        model=str(model),
        plain_tps=plain,
        beta=verify[1],
        delta=delta,
        runs=runs,
        verify_costs=verify,
        no_mtp_tps=no_mtp,
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        moe_dtype=m.moe_dtype,
    )


# ---------------------------------------------------------------------------------------
# A random-weight model of a real shape, for speed measurements that need size, not skill.

# Qwen3.5-0.8B's text config (hidden 1024, 24 layers in 3:1 linear/full attention, tied
# 248k vocabulary).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_5-0.8b": {
        "model_type": "qwen3_5_text",
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
    },
}


def build_random_model(
    shape: str,
    out: Path,
    *,
    bits: int = 4,
    group_size: int = 64,
    tokenizer_from: Path | None = None,
) -> Path:
    """Write a random-weight mlx-lm directory of `shape`, quantized, with an MTP sidecar.

    Scales and unquantized weights are float32: MLX's CPU backend multiplies 4-bit weights
    with float32 scales about ten times faster than with bfloat16 ones (on Apple silicon
    the GPU runs either at the same speed).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import quantize_model, save_config, save_model

    from mtpkit.headload import build_head

    text = dict(RANDOM_SHAPES[shape])
    config: dict[str, Any] = {
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    _scale_init(model)
    model, config = quantize_model(model, config, group_size, bits)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(config, out / "config.json")
    head = build_head(config, 1)
    _scale_init(head)
    nn.quantize(head, group_size=group_size, bits=bits)
    (out / "mtp").mkdir(exist_ok=True)
    weights = {f"language_model.mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(
        str(out / "mtp" / "weights.safetensors"), weights, metadata={"format": "mlx"}
    )
    manifest = {
        "format": "mtpkit",
        "family": "qwen3_5",
        "prefix": "language_model.mtp.",
        "num_layers": 1,
        "rmsnorm_weight_format": "mlx_gamma",
        "hidden": "post_norm",
        "concat_order": "embedding_first",
        "mtp_quantization": {"bits": bits, "group_size": group_size},
        "note": f"random weights of shape {shape}, built by mtpkit bench",
    }
    (out / "mtp" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix in (".jinja",):
                shutil.copy(f, out / f.name)
    return out


def _scale_init(module: nn.Module, dtype: mx.Dtype = mx.float32) -> None:
    """Small random weights (A_log stays float32, as mlx-lm keeps it), so activations stay
    finite through a deep random stack."""
    from mlx.utils import tree_flatten, tree_unflatten

    params = []
    for k, v in tree_flatten(module.parameters()):
        if v.ndim >= 2 and "conv1d" not in k:
            v = mx.random.normal(v.shape) * 0.02
        params.append((k, v if k.endswith("A_log") else v.astype(dtype)))
        mx.eval(params[-1][1])
    module.update(tree_unflatten(params))


def random_model_dir(shape: str) -> Path:
    """A temporary directory holding a random model of `shape` (the caller removes it)."""
    from importlib.resources import files

    if shape not in RANDOM_SHAPES:
        raise MtpkitError(f"unknown shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    tmp = Path(tempfile.mkdtemp(prefix=f"mtpkit-bench-{shape}-"))
    tok = Path(str(files("mtpkit") / "examples" / "tiny-qwen3_5"))
    return build_random_model(shape, tmp / shape, tokenizer_from=tok)


def print_bench(result: BenchResult) -> None:
    """The table people read (stdout)."""
    from rich.table import Table

    from mtpkit.output import stdout

    experts = f", experts in {result.moe_dtype}" if result.moe_dtype else ""
    stdout.print(
        f"[bold]{result.model}[/bold]: prompt {result.prompt_tokens} tokens, "
        f"{result.max_tokens} generated per run{experts}"
    )
    stdout.print(
        f"plain (stock mlx-lm): {result.plain_tps:.1f} tok/s; mtpkit --no-mtp: "
        f"{result.no_mtp_tps:.1f} tok/s"
    )
    costs = ", ".join(f"{k + 1} tokens {v:.2f}" for k, v in sorted(result.verify_costs.items()))
    stdout.print(
        f"beta {result.beta:.3f}, delta {result.delta:.3f}, beta+delta "
        f"{result.beta + result.delta:.3f} (verify cost over a 1-token forward: {costs})"
    )
    table = Table(title_justify="left")
    for col in ("depth", "acceptance", "by depth", "tok/s", "speedup", "ceiling"):
        table.add_column(col, justify="left" if col == "by depth" else "right")
    for r in result.runs:
        by_depth = " ".join("-" if a is None else f"{a:.0%}" for a in r.acceptance_by_depth)
        table.add_row(
            str(r.depth),
            "-" if r.acceptance is None else f"{r.acceptance:.1%}",
            by_depth,
            f"{r.decode_tps:.1f}",
            f"{r.speedup:.2f}x",
            "-" if r.ceiling is None else f"{r.ceiling:.2f}x",
        )
    stdout.print(table)
