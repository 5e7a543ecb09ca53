"""Run an mtpkit conversion in the MLX runtimes users already have, each through its own MTP
code path, and compare its greedy output with stock mlx-lm's (issue 20).

Each peer lives in its own virtual environment (they pin other mlx-lm versions and some pull
torch), installed from the package registry, e.g.:

    python3 -m venv /tmp/vlm && /tmp/vlm/bin/pip install "mlx-vlm==0.7.10" "mlx[cpu]"
    python3 -m venv /tmp/mtplx && /tmp/mtplx/bin/pip install "mtplx==2.12.2" \\
        "mlx[cpu]==0.32.2" "mlx-lm>=0.31,<0.32" "transformers>=5.10,<5.17,!=5.13.0"
    python3 -m venv /tmp/rapid && /tmp/rapid/bin/pip install "rapid-mlx==0.16.10" "mlx[cpu]"
    python3 -m venv /tmp/vmlx && /tmp/vmlx/bin/pip install "vllm-mlx==0.6.0" "mlx[cpu]"

then, with mtpkit's own environment (stock mlx-lm 0.32 is the reference):

    .venv/bin/mtpkit convert mtpkit/examples/tiny-qwen3_5 -o tiny-mlx
    .venv/bin/python scripts/run_peers.py tiny-mlx --mlx-vlm /tmp/vlm --mtplx /tmp/mtplx \\
        --rapid-mlx /tmp/rapid --vllm-mlx /tmp/vmlx

What runs where:
- mlx-vlm: `load_drafter(DIR, kind="mtp")` + its speculative `generate_step` (one draft per
  round); tokens compared with stock mlx-lm's, acceptance from the drafter's counts.
- MTPLX: `mtplx.runtime.load(DIR, mtp=True)` + `generate_mtp1`; on Linux its import-time
  mach clock (`/usr/lib/libSystem.B.dylib`) gets a stand-in (monotonic ns, timebase 1/1).
- Rapid-MLX: `rapid-mlx serve DIR --enable-mtp --mtp-sidecar DIR` on a loopback port, one
  greedy completion; text compared with stock's up to its first end of text, acceptance from
  the response's `metrics.speculative_decoding`.
- vllm-mlx: its text path (`serve DIR --enable-mtp --continuous-batching`) is started and its
  log read (does it load the head, trust the manifest, keep MTP on); its MLLM path runs an
  mlx-vlm drafter split from DIR (`python -m mlx_vlm.split_mtp`) with `--mllm
  --mllm-draft-model DRAFTER --mllm-draft-kind mtp` and reports `/v1/status`'s `mtp`.
Servers listen on 127.0.0.1 only, are polled a bounded number of times and are stopped by
their own process id.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPT = "Create a new event loop. You"

MACOS_CLOCK = r"""
import ctypes, time
class _Fn:
    def __init__(self, f): self.f, self.restype, self.argtypes = f, None, None
    def __call__(self, *a): return self.f(*a)
def _timebase(ref):
    ref._obj.numer = 1; ref._obj.denom = 1; return 0
class _LibSystem:
    mach_timebase_info = _Fn(_timebase)
    mach_continuous_time = _Fn(time.monotonic_ns)
    mach_absolute_time = _Fn(time.monotonic_ns)
    sysctlbyname = _Fn(lambda *a: -1)
_CDLL = ctypes.CDLL
class CDLL(_CDLL):
    def __new__(cls, name, *a, **k):
        return _LibSystem() if isinstance(name, str) and "libSystem" in name else _CDLL(name, *a, **k)
ctypes.CDLL = CDLL
"""

MLX_VLM = r"""
import json, sys
import mlx.core as mx
from mlx_vlm.generate.ar import generate_step
from mlx_vlm.speculative.drafters import load_drafter
from mlx_vlm.utils import load
model_dir, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model, _ = load(model_dir)
drafter, kind = load_drafter(model_dir, kind="mtp")
tokens = []
for t, _ in generate_step(mx.array([ids]), model, None, None, max_tokens=n, temperature=0.0,
                          draft_model=drafter, draft_kind=kind, draft_block_size=2):
    tokens.extend(t if isinstance(t, list) else [int(t)])
print(json.dumps({"tokens": tokens[:n], "accepted": sum(drafter.accept_lens),
                  "drafted": sum(drafter.draft_lens)}))
"""

MTPLX = r"""
import json, sys
from mtplx.generation import generate_mtp1
from mtplx.runtime import load
from mtplx.sampling import SamplerConfig
model_dir, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
rt = load(model_dir, mtp=True)
out = generate_mtp1(rt, ids, max_tokens=n, sampler=SamplerConfig(temperature=0.0),
                    stop_token_ids=set())
stats = out.stats.to_dict()
print(json.dumps({"tokens": list(out.tokens)[:n], "mtp": rt.mtp_enabled,
                  "accepted": stats["accepted_drafts"], "drafted": stats["drafted_tokens"]}))
"""


def stock(model_dir: Path, n: int) -> tuple[list[int], list[int], str]:
    """Prompt ids, stock mlx-lm's greedy tokens (EOS ignored) and its text up to end of text."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.encode(PROMPT)
    tokens = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=n)]
    eos = set(tokenizer.eos_token_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return ids, tokens, tokenizer.decode(tokens[:cut])


def _python(venv: Path, code: str, *args: str, timeout: int = 600) -> dict[str, Any]:
    run = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, payload: dict | None = None, timeout: float = 300) -> dict[str, Any]:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class Server:
    """A peer's server on a loopback port, stopped by its own process id."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.port = _free_port()
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def ready(self, tries: int = 120) -> bool:
        for _ in range(tries):  # bounded: at most `tries` seconds
            if self.process.poll() is not None:
                return False
            try:
                _http(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                return True
            except OSError:
                time.sleep(1)
        return False

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def run_mlx_vlm(venv: Path, model_dir: Path, ids: list[int], ref: list[int], n: int) -> dict:
    out = _python(venv, MLX_VLM, str(model_dir), json.dumps(ids), str(n))
    if "error" in out:
        return out
    return {"mtp": True, "equal": out["tokens"] == ref, **_rate(out)}


def run_mtplx(venv: Path, model_dir: Path, ids: list[int], ref: list[int], n: int) -> dict:
    out = _python(venv, MACOS_CLOCK + MTPLX, str(model_dir), json.dumps(ids), str(n))
    if "error" in out:
        return out
    return {"mtp": out["mtp"], "equal": out["tokens"] == ref, **_rate(out)}


def run_rapid(venv: Path, model_dir: Path, text: str, n: int, logs: Path) -> dict:
    argv = [str(venv / "bin" / "rapid-mlx"), "serve", str(model_dir)]
    server = Server([*argv, "--enable-mtp", "--mtp-sidecar", str(model_dir)], logs / "rapid.log")
    try:
        if not server.ready():
            return {"error": "server did not start: " + server.text()[-300:]}
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        reply = _http(url, {"prompt": PROMPT, "max_tokens": n, "temperature": 0})
        spec = (reply.get("metrics") or {}).get("speculative_decoding") or {}
        got = reply["choices"][0]["text"]
        accepted, drafted = (
            sum(spec.get("accepted_by_depth", [])),
            sum(spec.get("drafted_by_depth", [])),
        )
        return {
            "mtp": bool(drafted),
            "equal": got.strip() == text.strip(),
            **_rate({"accepted": accepted, "drafted": drafted}),
        }
    finally:
        server.stop()


def run_vllm_mlx(venv: Path, model_dir: Path, logs: Path) -> dict:
    bin_ = str(venv / "bin" / "vllm-mlx")
    text_path = Server(
        [bin_, "serve", str(model_dir), "--enable-mtp", "--continuous-batching"],
        logs / "vllm-mlx-text.log",
    )
    try:
        started = text_path.ready()
        log = text_path.text()
    finally:
        text_path.stop()
    result: dict[str, Any] = {
        "text_path_started": started,
        "head_loaded": "[MTP inject] Loaded" in log,
        "manifest_trusted": "Converter manifest declares MLX RMSNorm gamma" in log,
        "text_path_mtp_disabled": "MTP validation failed" in log,
    }
    drafter = logs / "drafter"
    split = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "mlx_vlm.split_mtp", "--model", str(model_dir), "--output", str(drafter)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if split.returncode != 0:
        return {**result, "error": "mlx_vlm.split_mtp failed: " + split.stderr[-300:]}
    mllm = Server(
        [bin_, "serve", str(model_dir), "--mllm", "--mllm-draft-model", str(drafter),
         "--mllm-draft-kind", "mtp", "--default-mllm-draft"],
        logs / "vllm-mlx-mllm.log",
    )  # fmt: skip
    try:
        if not mllm.ready():
            return {**result, "error": "MLLM server did not start"}
        status = _http(f"http://127.0.0.1:{mllm.port}/v1/status")
        result["mllm_mtp"] = status.get("mtp")
    finally:
        mllm.stop()
    return result


def _rate(out: dict) -> dict:
    drafted = out.get("drafted") or 0
    return {"acceptance": out["accepted"] / drafted if drafted else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="an mtpkit conversion")
    for name in ("mlx-vlm", "mtplx", "rapid-mlx", "vllm-mlx"):
        parser.add_argument(f"--{name}", type=Path, help=f"the virtual environment of {name}")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    ids, ref, text = stock(args.model, args.max_tokens)
    logs = Path(tempfile.mkdtemp(prefix="peers-"))
    results: dict[str, Any] = {}
    try:
        if args.mlx_vlm:
            results["mlx-vlm"] = run_mlx_vlm(args.mlx_vlm, args.model, ids, ref, args.max_tokens)
        if args.mtplx:
            results["MTPLX"] = run_mtplx(args.mtplx, args.model, ids, ref, args.max_tokens)
        if args.rapid_mlx:
            results["Rapid-MLX"] = run_rapid(
                args.rapid_mlx, args.model, text, args.max_tokens, logs
            )
        if args.vllm_mlx:
            results["vllm-mlx"] = run_vllm_mlx(args.vllm_mlx, args.model, logs)
    finally:
        if not os.environ.get("KEEP_PEER_LOGS"):
            shutil.rmtree(logs, ignore_errors=True)
    if args.json:
        print(
            json.dumps(
                {"model": str(args.model), "max_tokens": args.max_tokens, "peers": results},
                indent=2,
            )
        )
        return 0
    for name, result in results.items():
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
