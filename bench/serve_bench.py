"""`mtpkit serve` against `mlx_lm.server` on the same model directory: now
`mtpkit bench --serve` (mtpkit/bench/serve.py); this script runs it on the bundled example,
converted, unless given `--model`, passing every other argument through.

    .venv/bin/python bench/serve_bench.py --clients 1,4,16 --max-tokens 128
    .venv/bin/python bench/serve_bench.py --model DIR --json > serve.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"


def main() -> None:
    from mtpkit.cli.entry import main as mtpkit_main

    args = sys.argv[1:]
    if "--model" not in args and "--random" not in args:
        from mtpkit.convert.pipeline import convert

        model = str(Path(tempfile.mkdtemp(prefix="serve-bench-")) / "tiny-mlx")
        convert(str(EXAMPLE), output=model)
        args = ["--model", model, *args]
    sys.argv = ["mtpkit", "bench", "--serve", *args]
    mtpkit_main()


if __name__ == "__main__":
    main()
