"""Benchmark: `mtpkit convert` against stock `mlx_lm.convert`, side by side, at --bits 4.

Builds two synthetic Qwen3.5 dense checkpoints (random bf16 weights in the published raw
layout, MTP head included) of about 3 GB and 6 GB, converts each with both tools in fresh
processes, and prints wall time, peak RSS and the ratios the convert issue asks for:

    mtpkit wall / mlx_lm wall        <= 0.75
    mtpkit peak RSS / mlx_lm RSS     <= 0.5
    mtpkit RSS growth 3 GB -> 6 GB   <= 10 %

It also grafts the head of the 3 GB model from a loopback Hub stand-in and prints the bytes
served against the bytes the head needs (<= 1.02x + 1 MiB).

    python bench/bench_convert.py [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = {"3GB": 24, "6GB": 48}  # decoder layers at hidden 2048 (about 0.11 GB each in bf16)
SHARD_BYTES = 1 << 30


def _config(layers: int) -> dict:
    from tests.fixtures.qwen3_5 import qwen3_5_config

    config = qwen3_5_config(moe=False, vocab_size=32768, dtype="bfloat16")
    text = config["text_config"]
    text.update(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=layers,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        head_dim=128,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
    )
    text["rope_parameters"]["mrope_section"] = [11, 11, 10]
    return config


def build(path: Path, layers: int) -> None:
    """Write a raw Qwen3.5 checkpoint whose names and shapes come from mlx-lm's own model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mtpkit.convert.quant import build_model
    from mtpkit.families import family_for
    from tests.checkpoints import write_tokenizer

    config = _config(layers)
    model = build_model(config)
    family = family_for(config)
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    head = {k: v.shape for k, v in tree_flatten(family.head_module(model, 1).parameters())}
    names: list[tuple[str, tuple[int, ...]]] = []
    for k, shape in shapes.items():
        name = k.replace("language_model.model.", "model.language_model.", 1)
        name = name.replace("language_model.lm_head", "lm_head", 1)
        if name.endswith("conv1d.weight"):
            shape = (shape[0], 1, shape[1])  # the HF Conv1d layout
        names.append((name, tuple(shape)))
    names += [(k.replace("language_model.mtp.", "mtp.", 1), tuple(s)) for k, s in head.items()]

    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in names:
        nbytes = 2 * int(mx.array(shape).prod().item()) if shape else 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    key = mx.random.key(0)
    for i, group in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays = {}
        for name, shape in group:
            key, sub = mx.random.split(key)
            if len(shape) == 1:
                arrays[name] = (mx.random.normal(shape, key=sub) * 0.05).astype(mx.bfloat16)
            else:
                arrays[name] = (mx.random.normal(shape, key=sub) * 0.02).astype(mx.bfloat16)
            weight_map[name] = file
            total += arrays[name].nbytes
        mx.save_safetensors(str(path / file), arrays, metadata={"format": "pt"})
        del arrays
    (path / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        )
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, 512)


RUNNER = r"""
import json, sys, time, io, contextlib
tool, src, out = sys.argv[1:4]
t = time.perf_counter()
if tool == "mlx_lm":
    from mlx_lm.convert import convert
    with contextlib.redirect_stdout(io.StringIO()):
        convert(src, out, quantize=True, q_bits=4, q_group_size=64)
else:
    from mtpkit.convert.pipeline import convert
    convert(src, output=out, bits=4, quiet=True)
wall = time.perf_counter() - t
# VmHWM is this process image's own peak RSS; ru_maxrss would also count the parent's,
# which Linux carries across fork and exec.
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"wall": wall, "rss": int(hwm.split()[1]) * 1024}))
"""


def _warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def measure(tool: str, src: Path, out: Path, *, keep: bool = False) -> dict:
    """One conversion in a fresh process (page cache warm): wall seconds and peak RSS bytes."""
    shutil.rmtree(out, ignore_errors=True)
    _warm(src)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_PROGRESS_BARS="1")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, tool, str(src), str(out)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def side_by_side(runs: int, src: Path, work: Path, label: str) -> tuple[dict, dict]:
    """Both tools, alternating, `runs` times each: the fastest wall time of each (the machine
    may be shared) and the largest peak RSS seen."""
    seen: dict[str, list[dict]] = {"mlx_lm": [], "mtpkit": []}
    for _ in range(runs):
        seen["mlx_lm"].append(measure("mlx_lm", src, work / "out-mlx_lm"))
        seen["mtpkit"].append(measure("mtpkit", src, work / f"out-mtpkit-{label}", keep=True))
    best = {
        tool: {"wall": min(r["wall"] for r in rs), "rss": max(r["rss"] for r in rs)}
        for tool, rs in seen.items()
    }
    return best["mlx_lm"], best["mtpkit"]


def graft_bytes(src: Path, trunk: Path, work: Path) -> tuple[int, int]:
    """Bytes the Hub stand-in served for a graft, and the bytes the head needs."""
    import huggingface_hub.hf_api  # noqa: F401 - point_client_at patches it
    import pytest

    from mtpkit.checkpoint.report import inspect_checkpoint
    from mtpkit.convert.grafting import graft
    from tests.hub_server import HubStandIn, point_client_at

    needed = inspect_checkpoint(str(src))["mtp"]["bytes_needed"]
    server = HubStandIn()
    server.start()
    mp = pytest.MonkeyPatch()
    try:
        from huggingface_hub import close_session

        point_client_at(server.url, work / "hf_home", mp)
        close_session()
        server.add_repo("bench/qwen3_5", src)
        server.reset_counters()
        graft("bench/qwen3_5", into=trunk, force=True)
        served = server.total_bytes("bench/qwen3_5")
    finally:
        mp.undo()
        server.stop()
    return served, needed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoints")
    parser.add_argument("--runs", type=int, default=3, help="runs per tool and size (best kept)")
    parser.add_argument("--build", nargs=2, metavar=("DIR", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        build(Path(args.build[0]), int(args.build[1]))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mtpkit-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        for label, layers in SIZES.items():
            src = work / f"src-{label}"
            if not (src / "config.json").exists():
                # In a child process, so that this one stays small.
                subprocess.run(
                    [sys.executable, __file__, "--build", str(src), str(layers)],
                    check=True,
                    env=dict(os.environ, PYTHONPATH=str(ROOT)),
                )
            size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
            stock, mine = side_by_side(args.runs, src, work, label)
            results[label] = {"bytes": size, "mlx_lm": stock, "mtpkit": mine}
            print(
                f"{label} ({size / 1e9:.2f} GB): mlx_lm {stock['wall']:.1f} s / "
                f"{stock['rss'] / 2**30:.2f} GiB, mtpkit {mine['wall']:.1f} s / "
                f"{mine['rss'] / 2**30:.2f} GiB; wall ratio {mine['wall'] / stock['wall']:.2f}, "
                f"RSS ratio {mine['rss'] / stock['rss']:.2f}",
                flush=True,
            )
        small, large = results["3GB"]["mtpkit"]["rss"], results["6GB"]["mtpkit"]["rss"]
        print(f"mtpkit RSS growth 3GB -> 6GB: {100 * (large / small - 1):+.1f}%")
        # The head grafted into mtpkit's own 4-bit conversion (it replaces the head there).
        served, needed = graft_bytes(work / "src-3GB", work / "out-mtpkit-3GB", work)
        print(
            f"graft from Hub stand-in: {served} bytes served for {needed} needed "
            f"(ratio {served / needed:.4f}; limit 1.02x + 1 MiB = {1.02 * needed + (1 << 20):.0f})"
        )
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
