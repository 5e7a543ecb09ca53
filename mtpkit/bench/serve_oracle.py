"""`mtpkit bench --serve --acceptance A`: SYNTHETIC serving figures at a stated acceptance, so
a random model of a real size is measured as a head of acceptance A would serve it.

mtpkit serve runs with `--oracle-acceptance A` (`mtpkit/serve/oracle.py`): a greedy request
whose prompt it has answered before decodes with oracle drafts over that answer. So before
the timed levels every prompt they send (the late long prompt included) is sent once,
untimed, at the levels' `max_tokens` (`warm_up`), to both servers alike (mlx_lm.server's
prompt cache sees the same prompts). The realized acceptance is read from mtpkit's responses
(vLLM's `metrics.speculative_decoding`): A is each draft's chance to be right once the drafts
before it were kept, as `bench --acceptance` states it, so it is the first draft's share kept
(vLLM's per-position rate at position 0); the drafted/accepted share, which counts the
deeper drafts too, is lower at depths above 1 by design.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mtpkit.bench.serve_load import Sample, ServeBenchError, level_prompts, long_prompt, run_round

if TYPE_CHECKING:
    from mtpkit.bench.serve import ServeBenchSettings
    from mtpkit.bench.serve_servers import ServerProcess


def timed_prompts(settings: ServeBenchSettings) -> list[str]:
    """Every prompt the timed levels send, once each, in the order they first send it."""
    prompts: dict[str, None] = {}
    for clients in settings.levels:
        for r in range(settings.rounds):
            prompts.update(dict.fromkeys(level_prompts(clients, r)))
    if settings.long_prompt_tokens and max(settings.levels) > 1:
        prompts[long_prompt(settings.long_prompt_tokens)] = None
    return list(prompts)


def warm_up(servers: list[ServerProcess], settings: ServeBenchSettings) -> None:
    """Each timed prompt answered once by each server (untimed), as many at once as the
    highest level: mtpkit serve's answers are what its oracle drafts over."""
    prompts = timed_prompts(settings)
    width = max(settings.levels)
    for server in servers:
        for i in range(0, len(prompts), width):
            chunk = prompts[i : i + width]
            _, _, errors = run_round(server.url, settings.model, chunk, settings.max_tokens)
            if errors:
                raise ServeBenchError(f"{server.name} failed the oracle's warm-up: {errors[0]}")


def first_draft_acceptance(samples: list[Sample]) -> float | None:
    """The share of drafting rounds whose first draft was kept, over `samples`' responses
    (None: no round drafted, or no response said)."""
    specs = [s.spec for s in samples if s.spec]
    steps = sum(x["num_spec_steps"] for x in specs)
    missed = sum(x["acceptance_histogram"][0] for x in specs if x["acceptance_histogram"])
    return (steps - missed) / steps if steps else None


def synthetic_summary(acceptance: float, samples: list[Sample]) -> dict[str, Any]:
    """The SYNTHETIC mark of a result: the oracle's A, the acceptance realized over every
    timed mtpkit request, and how many of them the oracle drafted (all, after `warm_up`)."""
    return {
        "oracle_acceptance": acceptance,
        "realized_acceptance": first_draft_acceptance(samples),
        "requests": len(samples),
        "oracle_requests": sum(s.synthetic is not None for s in samples),
        "note": "SYNTHETIC: mtpkit serve --oracle-acceptance; the head runs, its drafts "
        "are replaced by the answer's tokens (right with the probability stated) and its "
        "verdicts held to that plan: what a head of that acceptance would serve",
    }
