"""How many graph nodes a batched drafting round builds, by width, against a plain batched step
(issue 30). MLX's CUDA backend is bound by the host's graph building and launches, roughly a
cost per node, so a round whose node count grows with the rows costs more per row than its
arithmetic; the count is the same on any device, so this runs on the CPU too.

    python bench/batch_round_nodes.py [SHAPE] [LAYERS] [WIDTHS]   # qwen3_5-0.8b 4 1,4,8

For each width B: B rows of one prompt join a `BatchDecoder` at depth 1, a few rounds run,
then the nodes of every evaluation one round (or one plain step) asks for are counted
(`mx.export_to_dot` of what `mx.eval` / `mx.async_eval` are given: evaluated arrays are
leaves, so each evaluation counts the nodes built since the last; the caches and the head's
output are evaluated before each count and, for a round, inside it, so a round's lazy
rollback counts in the round and nowhere else), the kinds a round has
most beyond a plain step, and the kinds that grow with B between the first and last width.
"""

from __future__ import annotations

import io
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtpkit.bench.shapes import random_model_dir  # noqa: E402
from mtpkit.runtime.model import load_model  # noqa: E402
from mtpkit.speculative.batch import BatchDecoder  # noqa: E402


def labels(arrays: list) -> Counter:
    flat = [a for _, a in tree_flatten(arrays) if isinstance(a, mx.array)]
    if not flat:
        return Counter()
    f = io.StringIO()
    mx.export_to_dot(f, *flat)
    return Counter(re.findall(r'label ="([^"]+)"', f.getvalue()))


def counted(step: Callable[[], object]) -> Counter:
    """The nodes of every evaluation `step` asks for, summed by kind."""
    total: Counter = Counter()
    evaluate, launch = mx.eval, mx.async_eval

    def eval_(*args):
        total.update(labels(list(args)))
        return evaluate(*args)

    def async_eval_(*args):
        total.update(labels(list(args)))
        return launch(*args)

    mx.eval, mx.async_eval = eval_, async_eval_
    try:
        step()
    finally:
        mx.eval, mx.async_eval = evaluate, launch
    return total


def states(decoder: BatchDecoder) -> list:
    """What a step leaves lazy for the next: the caches it rolled back, the head's output."""
    caches = [c.state for c in decoder.cache] + [c.state for c in decoder.head.cache]
    return [caches, decoder.head.ready]


def main() -> int:
    shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3_5-0.8b"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    widths = [int(w) for w in (sys.argv[3] if len(sys.argv) > 3 else "1,4,8").split(",")]
    m = load_model(random_model_dir(shape, "float32", layers=layers))
    m.tokenizer.eos_token_ids = []
    prompt = list(range(100, 132))
    per_width = {}
    for width in widths:
        decoder = BatchDecoder(m, depth=1)
        decoder.eos = set()
        for _ in range(width):
            decoder.add(prompt, max_tokens=64)
        for _ in range(3):
            decoder.step()
        mx.eval(states(decoder))  # each count below starts from evaluated caches
        round_nodes = counted(lambda d=decoder: (d.step(), mx.eval(states(d))))
        last = mx.array([[row.last] for row in decoder.rows], dtype=mx.int32)
        plain_nodes = counted(lambda d=decoder, last=last: mx.eval(d._plain_forward(last)))
        per_width[width] = (round_nodes, plain_nodes)
        print(f"batch {width}: round {sum(round_nodes.values())} nodes, plain step "
              f"{sum(plain_nodes.values())}")  # fmt: skip
    round_nodes, plain_nodes = per_width[widths[-1]]
    print(f"kinds a round at batch {widths[-1]} has most beyond a plain step:")
    extra = {k: (plain_nodes.get(k, 0), v) for k, v in round_nodes.items()}
    for kind, (a, b) in sorted(extra.items(), key=lambda kv: kv[1][0] - kv[1][1])[:15]:
        print(f"  {kind}: {a} -> {b}")
    first, last = per_width[widths[0]][0], per_width[widths[-1]][0]
    grown = {k: (first.get(k, 0), v) for k, v in last.items() if v > first.get(k, 0)}
    print(f"kinds of a round that grow from batch {widths[0]} to {widths[-1]}:")
    for kind, (a, b) in sorted(grown.items(), key=lambda kv: kv[1][0] - kv[1][1]):
        print(f"  {kind}: {a} -> {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
