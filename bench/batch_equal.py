"""How often batched greedy rows equal their own single stream and stock mlx-lm's (issue 43).

    python bench/batch_equal.py MODEL_DIR [--prompts 8] [--max-tokens 128] [--depth D]
        [--no-adaptive] [--rows-alone] [--json] [--save FILE.json]

MODEL_DIR is a converted model with its head (`mtpkit convert mtpkit/examples/tiny-qwen3_5
-o DIR -q` for the bundled example at 4-bit). The prompts are the serving bench's
mixed-length ones (`mtpkit.bench.serve_load.mixed_prompts`), taken as text (no chat
template). Every prompt is decoded greedily, ending at an EOS or `--max-tokens`, by:
  stock               stock mlx-lm's `stream_generate`, one prompt at a time (the reference)
  stock_batch         stock mlx-lm's `batch_generate`, every prompt at once
  mtpkit_single_head  `mtpkit.generate` drafting with the head, one prompt at a time
  mtpkit_single_none  `mtpkit.generate(mtp=False)` (`--no-mtp`), one prompt at a time
  mtpkit_batch_head   `generate -p A -p B ...`'s path (`generate_batch`), head, every prompt
  mtpkit_batch_none   the same without a drafter (plain batched steps)
  mtpkit_batch1_head  (`--rows-alone`) the batch path, each prompt a batch of its own
Stock's runs use a load of their own, untouched by mtpkit's taps. `--depth` and
`--no-adaptive` go to every mtpkit run that drafts (default: what `generate` does).

Printed per prompt (its length, stock's token count) and in total: whether each run equals
`stock`, and whether each mtpkit batch equals its own single stream; where two part, the
first index at which they do and the top-2 margin of stock's logits there (one forward of
the shared prefix on stock's load, a prefill's shapes rather than a decode step's). A
margin of at most one bf16 ulp of the top logit (`tie`) says the parting is reduction order
(two kernels summing in another order), not a wrong token. `--json`: the same as one object
(`prompts[i].comparisons[NAME]`: equal, parts_at, tokens, top2, margin, ulp, near_tie;
`totals[NAME]`: equal, of, near_ties; `drafting[RUN]`: drafted, accepted, each head run's
drafts over every prompt, so that a run whose rounds all fell back to plain steps shows);
`--save FILE.json` writes it beside the table.

Not here: a batch verifying each row in its own pass (B = 1 shapes inside a batch, as
mlx-vlm's singleton-equivalent verify does on Metal): the decoder verifies the merged,
left-padded caches in one pass and has no hook to split it without extracting and merging
every row's caches each round. `--rows-alone` answers the nearer question: whether the
batch path at B = 1 equals one stream (then a parting at B = 8 comes from the width's
shapes, and a singleton verify would remove it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from mtpkit.bench.report import device_name
from mtpkit.bench.serve_load import mixed_prompts
from mtpkit.core.errors import MtpkitError
from mtpkit.core.files import write_text_file
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_model
from mtpkit.speculative.batch.generate import generate_batch
from mtpkit.speculative.generate import GenerationResult, generate

# (run, the run it is held to): each mtpkit batch also against its own single stream.
COMPARISONS = [
    ("stock_batch", "stock"),
    ("mtpkit_single_head", "stock"),
    ("mtpkit_single_none", "stock"),
    ("mtpkit_batch_head", "stock"),
    ("mtpkit_batch_none", "stock"),
    ("mtpkit_batch_head", "mtpkit_single_head"),
    ("mtpkit_batch_none", "mtpkit_single_none"),
]
ROWS_ALONE = [("mtpkit_batch1_head", "stock"), ("mtpkit_batch1_head", "mtpkit_single_head")]
BF16_MANTISSA_BITS = 7  # explicit fraction bits: values in [2^e, 2^(e+1)) lie 2^(e-7) apart
# A function a test passes to change a run's tokens (run name, its rows) -> rows.
Perturb = Callable[[str, list[list[int]]], list[list[int]]]


def stock_single(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Stock mlx-lm's greedy tokens, the EOS that ends them excluded (as `batch_generate`
    and mtpkit report them)."""
    out = []
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens):
        if r.finish_reason == "stop":
            break
        out.append(r.token)
    return out


def decode_all(
    path: Path, model: Any, tokenizer: Any, prompts: list[list[int]], *, max_tokens: int,
    depth: int | None, adaptive: bool, rows_alone: bool, log: Callable[[str], None],
) -> tuple[dict[str, list[list[int]]], dict[str, dict[str, int]]]:  # fmt: skip
    """Every run's tokens per prompt, and what each head run drafted and kept (a run that
    drafted nothing took plain steps only: its equality says nothing of the verify pass);
    stock's runs on `model`, mtpkit's on a load of its own."""
    m = load_model(path)
    drafting = {"depth": depth, "adaptive": adaptive}
    runs: dict[str, list[list[int]]] = {}
    results: dict[str, list[GenerationResult]] = {}
    log("stock mlx-lm, one stream per prompt")
    runs["stock"] = [stock_single(model, tokenizer, p, max_tokens) for p in prompts]
    log(f"stock mlx-lm's batch_generate, {len(prompts)} prompts")
    response = mlx_lm.batch_generate(
        model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True
    )
    runs["stock_batch"] = [list(t) for t in response.token_ids]
    log("mtpkit, one stream per prompt (head, then none)")
    results["mtpkit_single_head"] = [
        generate(m, p, max_tokens=max_tokens, **drafting) for p in prompts
    ]
    results["mtpkit_single_none"] = [
        generate(m, p, max_tokens=max_tokens, mtp=False) for p in prompts
    ]
    log(f"mtpkit's batch, {len(prompts)} prompts (head, then none)")
    results["mtpkit_batch_head"] = generate_batch(
        m, prompts, max_tokens=max_tokens, **drafting
    ).results
    results["mtpkit_batch_none"] = generate_batch(
        m, prompts, max_tokens=max_tokens, mtp=False
    ).results
    if rows_alone:
        log("mtpkit's batch path, each prompt alone (head)")
        results["mtpkit_batch1_head"] = [
            generate_batch(m, [p], max_tokens=max_tokens, **drafting).results[0] for p in prompts
        ]
    runs |= {name: [r.tokens for r in rs] for name, rs in results.items()}
    drafted = {name: {"drafted": sum(r.drafted for r in rs), "accepted": sum(r.accepted for r in rs)}
               for name, rs in results.items() if name.endswith("_head")}  # fmt: skip
    return runs, drafted


def first_parting(tokens: list[int], reference: list[int]) -> int | None:
    """The first index where the two differ (one ending before the other counts), or None."""
    for i, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def top2_margin(model: Any, prefix: list[int]) -> dict[str, Any]:
    """Stock's logits after `prefix` (one forward of it, a fresh cache): the top two tokens,
    the margin between their logits and a bf16 ulp at the top logit's magnitude."""
    logits = model(mx.array(prefix)[None], cache=make_prompt_cache(model))[0, -1]
    top = mx.argsort(-logits.astype(mx.float32))[:2].tolist()
    first, second = (float(logits[t].astype(mx.float32).item()) for t in top)
    scale = abs(first) or 1.0
    ulp = 2.0 ** (math.floor(math.log2(scale)) - BF16_MANTISSA_BITS)
    margin = first - second
    return {"top2": top, "margin": margin, "ulp": ulp, "near_tie": margin <= ulp,
            "logits_dtype": str(logits.dtype).removeprefix("mlx.core.")}  # fmt: skip


def compare_one(
    model: Any, prompt: list[int], tokens: list[int], reference: list[int]
) -> dict[str, Any]:
    """One comparison of one prompt: equal, or where it parts, the tokens each chose there
    (None: the run ended there, at an EOS) and stock's margin at that position."""
    at = first_parting(tokens, reference)
    if at is None:
        return {"equal": True, "parts_at": None}

    def token(run: list[int]) -> int | None:
        return run[at] if at < len(run) else None

    found = {"equal": False, "parts_at": at, "tokens": [token(tokens), token(reference)]}
    return found | top2_margin(model, prompt + reference[:at])


def compare(
    path: str | Path, prompts: list[str | list[int]], *, max_tokens: int = 128,
    depth: int | None = None, adaptive: bool = True, rows_alone: bool = False,
    perturb: Perturb | None = None, log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:  # fmt: skip
    """The report (`--json`'s object): every run decoded, every comparison per prompt and in
    total. A text prompt is encoded as it stands (no chat template). `perturb` changes a
    run's tokens before they are compared (tests: a check that can fail)."""
    path = Path(path)
    model, tokenizer = mlx_lm.load(str(path))
    prompts = [encode_prompt(tokenizer, p, chat_template=False) if isinstance(p, str) else p
               for p in prompts]  # fmt: skip
    runs, drafted = decode_all(path, model, tokenizer, prompts, max_tokens=max_tokens, depth=depth,
                      adaptive=adaptive, rows_alone=rows_alone, log=log)  # fmt: skip
    if perturb is not None:
        runs = {name: perturb(name, rows) for name, rows in runs.items()}
    pairs = COMPARISONS + (ROWS_ALONE if rows_alone else [])
    names = [f"{a} vs {b}" for a, b in pairs]
    per_prompt = []
    for i, prompt in enumerate(prompts):
        found = {n: compare_one(model, prompt, runs[a][i], runs[b][i])
                 for n, (a, b) in zip(names, pairs, strict=True)}  # fmt: skip
        per_prompt.append({"prompt_tokens": len(prompt),
                           "generated": {k: len(v[i]) for k, v in runs.items()},
                           "comparisons": found})  # fmt: skip
    totals = {}
    for n in names:
        parted = [p["comparisons"][n] for p in per_prompt if not p["comparisons"][n]["equal"]]
        totals[n] = {"equal": len(prompts) - len(parted), "of": len(prompts),
                     "near_ties": sum(c["near_tie"] for c in parted)}  # fmt: skip
    return {
        "model": str(path), "device": device_name(), "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"), "max_tokens": max_tokens, "depth": depth,
        "adaptive": adaptive, "drafting": drafted, "comparisons": names, "prompts": per_prompt,
        "totals": totals,
    }  # fmt: skip


def cell(c: dict[str, Any]) -> str:
    """A comparison as a table cell: `=`, or `@index` with the margin (`tie`: within an ulp)."""
    if c["equal"]:
        return "="
    return f"@{c['parts_at']} {c['margin']:.3g}{' tie' if c['near_tie'] else ''}"


def print_report(report: dict[str, Any]) -> None:
    names = report["comparisons"]
    print(f"{report['model']} on {report['device']} (mlx {report['mlx']}, mlx-lm "
          f"{report['mlx_lm']}), greedy, {report['max_tokens']} tokens at most")  # fmt: skip
    for name, d in report["drafting"].items():
        print(f"  {name}: {d['accepted']} of {d['drafted']} drafts accepted")
    for j, n in enumerate(names, 1):
        print(f"  [{j}] {n}")
    cells = [[cell(p["comparisons"][n]) for n in names] for p in report["prompts"]]
    width = max(len(c) for row in [[f"[{len(names)}]"], *cells] for c in row)
    heads = "  ".join(f"[{j}]".ljust(width) for j in range(1, len(names) + 1))
    print(f"prompt  tokens  stock  {heads}".rstrip())
    for i, (p, row) in enumerate(zip(report["prompts"], cells, strict=True), 1):
        line = "  ".join(c.ljust(width) for c in row)
        print(f"{i:>6}  {p['prompt_tokens']:>6}  {p['generated']['stock']:>5}  {line}".rstrip())
    for j, n in enumerate(names, 1):
        t = report["totals"][n]
        parted = t["of"] - t["equal"]
        ties = f" ({t['near_ties']} of the {parted} partings near-ties)" if parted else ""
        print(f"[{j}] {n}: {t['equal']} of {t['of']} equal{ties}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a converted model directory with its head")
    parser.add_argument("--prompts", type=int, default=8, help="how many mixed-length prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--depth", type=int, default=None, help="drafts a round (default: generate's)"
    )
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                        help="draft every round (default: adaptive drafting, as generate)")  # fmt: skip
    parser.add_argument("--rows-alone", action="store_true",
                        help="also the batch path with each prompt a batch of its own")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="the report as one JSON object")
    parser.add_argument("--save", type=Path, help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be at least 1")
    if not (args.model / "config.json").is_file():
        sys.exit(f"Error: {args.model} is not a model directory (no config.json)")
    try:
        report = compare(args.model, list(mixed_prompts(args.prompts)),
                         max_tokens=args.max_tokens, depth=args.depth, adaptive=args.adaptive,
                         rows_alone=args.rows_alone,
                         log=lambda s: print(s, file=sys.stderr))  # fmt: skip
    except MtpkitError as e:
        sys.exit(f"Error: {e}")
    if args.save is not None:  # atomically, never through a link (as every report mtpkit writes)
        try:
            write_text_file(args.save, json.dumps(report, indent=2) + "\n", option="--save")
        except MtpkitError as e:
            sys.exit(f"Error: {e}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
