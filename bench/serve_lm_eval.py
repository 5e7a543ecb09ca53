"""One lm-eval generative task against `mtpkit serve` and `mlx_lm.server` on the same model
directory: lm-eval's `local-completions` (text prompts) and `local-chat-completions`
(messages through the servers' chat template), greedy; the two servers' answers must be
equal, document by document.

The task is written here, offline (no dataset download): the bundled example's held-out
lines, the first eight words as the prompt and the next eight as the target, `generate_until`
a blank line or `--max-gen-toks` tokens, scored by exact match (a trained tiny model scores
near 0: the point is the servers' agreement, which the script prints and exits 1 without).

lm-eval is an optional dependency (`pip install 'mtpkit[lm-eval]'`: lm-eval 0.4.13 needs no
torch, but pulls some thirty packages, scikit-learn and nltk among them, so it is no test
dependency).

    .venv/bin/python bench/serve_lm_eval.py [--model DIR] [--limit 10] [--max-gen-toks 32]
        [--apis completions,chat] [--json]

Converts the bundled example when `--model` is not given; both servers get
`--chat-template` (the example's tokenizer has none) and decode one request at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from mtpkit.bench.serve_servers import start_servers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "mtpkit" / "examples" / "tiny-qwen3_5"
TASK = "mtpkit_heldout_continue"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
APIS = {  # lm-eval model name, route, whether lm-eval sends chat messages
    "completions": ("local-completions", "/v1/completions", False),
    "chat": ("local-chat-completions", "/v1/chat/completions", True),
}


def write_task(folder: Path, limit: int, max_gen_toks: int) -> None:
    """The task's yaml and its documents (jsonl) in `folder`, for lm-eval's `include_path`."""
    lines = [line for line in (EXAMPLE / "heldout.txt").read_text().splitlines() if line.strip()]
    docs = []
    for line in lines[:limit]:
        words = line.split()
        docs.append({"prompt": " ".join(words[:8]), "target": " " + " ".join(words[8:16])})
    data = folder / "heldout.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\n'
        'doc_to_target: "{{target}}"\n'
        "generation_kwargs:\n"
        '  until: ["\\n\\n"]\n'
        f"  max_gen_toks: {max_gen_toks}\n"
        "  do_sample: false\n"
        "  temperature: 0.0\n"
        "metric_list:\n"
        "  - metric: exact_match\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n"
    )


def evaluate(api: str, url: str, model: str, folder: Path, limit: int) -> dict[str, Any]:
    """lm-eval's run of the task against one server: its exact match and every answer."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    name, route, chat = APIS[api]
    args = {
        "model": model, "base_url": url + route, "tokenizer_backend": "None",
        "tokenized_requests": False, "num_concurrent": 1, "max_retries": 1,
    }  # fmt: skip
    out = lm_eval.simple_evaluate(
        model=name, model_args=args, tasks=[TASK], limit=limit, log_samples=True,
        task_manager=TaskManager(include_path=str(folder)), apply_chat_template=chat,
    )  # fmt: skip
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return {
        "exact_match": out["results"][TASK]["exact_match,none"],
        "answers": [s["resps"][0][0] for s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    apis = args.apis.split(",")
    if any(a not in APIS for a in apis):
        parser.error(f"--apis takes {', '.join(APIS)}, not {args.apis!r}")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        sys.exit("Error: lm-eval is not installed: pip install 'mtpkit[lm-eval]'")
    work = Path(tempfile.mkdtemp(prefix="serve-lm-eval-"))
    model = args.model
    if model is None:
        from mtpkit.convert.pipeline import convert

        model = str(work / "tiny-mlx")
        convert(str(EXAMPLE), output=model)
    write_task(work, args.limit, args.max_gen_toks)
    extra = ["--chat-template", TEMPLATE]
    servers = start_servers(model, work, extra, extra)
    try:
        results = {
            api: {s.name: evaluate(api, s.url, model, work, args.limit) for s in servers}
            for api in apis
        }
    finally:
        for server in servers:
            server.stop()
    agreed = report(results, args.json)
    sys.exit(0 if agreed else 1)


def report(results: dict[str, dict[str, dict[str, Any]]], as_json: bool) -> bool:
    """Per API: each server's exact match and how many answers the two servers share."""
    agreed = True
    rows = []
    for api, by_server in results.items():
        ours, theirs = by_server["mtpkit"]["answers"], by_server["mlx_lm"]["answers"]
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        agreed &= same == len(ours)
        rows.append((api, by_server, same, len(ours)))
    if as_json:
        print(json.dumps({api: {**r, "equal": same, "of": n} for api, r, same, n in rows}, indent=2))
        return agreed
    print("| lm-eval model | mtpkit exact match | mlx_lm exact match | answers equal |")
    print("|---|---|---|---|")
    for api, by_server, same, n in rows:
        name = APIS[api][0]
        ours, theirs = by_server["mtpkit"]["exact_match"], by_server["mlx_lm"]["exact_match"]
        print(f"| {name} | {ours:.2f} | {theirs:.2f} | {same}/{n} |")
    return agreed


if __name__ == "__main__":
    main()
