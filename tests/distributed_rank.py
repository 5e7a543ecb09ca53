"""One rank of a distributed decoding test, run under `mlx.launch` by tests/test_distributed.py.

    python tests/distributed_rank.py MODEL OUT_DIR PIPELINE(0|1) N_TOKENS REFERENCE_JSON

Loads this rank's part of MODEL (`load_sharded`), then at depths 1 and 2, with serial and
pipelined rounds (`1`, `2`, `1p`, `2p`), decodes N_TOKENS greedily with drafts injected on the ranks that run the head (right up to a planned depth each
round, then wrong: every partial acceptance happens on purpose), and writes what this rank saw
to OUT_DIR/rank{r}.json: its tokens, the drafts accepted per round, the plan, and the offsets
of its KV caches, so the test can check that every rank rolled back to the same position.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mtpkit.runtime.sharded import load_sharded, world  # noqa: E402
from mtpkit.speculative.accept import SamplingSettings  # noqa: E402
from mtpkit.speculative.decode import MtpDecoder  # noqa: E402
from tests.injected import accepted_per_round, inject_drafts, planned_per_round  # noqa: E402

PLAN = [0, 2, 1, 2, 0, 1] * 20


def main() -> None:
    model, out_dir, pipeline, n, reference_file = sys.argv[1:6]
    reference = json.loads(Path(reference_file).read_text())
    group = world()
    assert group is not None, "run under mlx.launch"
    m = load_sharded(model, group, pipeline=pipeline == "1")
    prompt = reference["prompt"]
    runs = {}
    for depth, pipelined in ((1, False), (2, False), (1, True), (2, True)):
        decoder = MtpDecoder(
            m, prompt, depth=depth, sampling=SamplingSettings(), adaptive=False,
            pipeline=pipelined,
        )  # fmt: skip
        plan: list[int] = []
        if m.head is not None:
            vocab = m.embedding.weight.shape[0]
            rights = inject_drafts(decoder, reference["tokens"], PLAN, vocab)
        tokens = list(decoder.tokens(int(n)))
        if m.head is not None:
            plan = planned_per_round(decoder, rights)
        offsets = [c.offset for c in decoder.cache if hasattr(c, "offset")]
        runs[f"{depth}{'p' if pipelined else ''}"] = {
            "tokens": tokens,
            "accepted": accepted_per_round(decoder),
            "plan": plan,
            "offsets": offsets,
            "has_head": m.head is not None,
        }
    result = {"rank": group.rank(), "size": group.size(), "sharding": m.lockstep.sharding}
    out = Path(out_dir) / f"rank{group.rank()}.json"
    out.write_text(json.dumps(result | {"runs": runs}))


if __name__ == "__main__":
    main()
