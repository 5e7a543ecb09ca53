"""Copy an MLX model directory with an MTP sidecar, the head's matrices replaced by random ones.

    python bench/useless_head.py /tmp/fast-tiny /tmp/fast-useless

The copy drafts almost nothing right, so `mtpkit bench` / `generate --mtp` on it measure
what drafting costs when it never pays (adaptive drafting should then stay within a few
percent of plain decoding). Each matrix keeps its shape, dtype and standard deviation; norm
weights and quantized layers' scales stay as they are (packed weights get random bits).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx


def randomize(src: Path, dst: Path, seed: int = 0) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    path = dst / "mtp" / "weights.safetensors"
    weights, metadata = mx.load(str(path), return_metadata=True)
    mx.random.seed(seed)
    out = {}
    for name, w in weights.items():
        if w.ndim < 2 or name.endswith((".scales", ".biases")):
            out[name] = w
        elif w.dtype == mx.uint32:  # packed quantized weight: random bits
            out[name] = mx.random.randint(0, 2**31, w.shape).astype(mx.uint32)
        else:
            std = mx.std(w.astype(mx.float32))
            out[name] = (mx.random.normal(w.shape) * std).astype(w.dtype)
    mx.save_safetensors(str(path), out, metadata=metadata)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    randomize(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {sys.argv[2]}")
