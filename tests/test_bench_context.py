"""`mtpkit bench --prompt-tokens N` (decoding after a long context) and what bench keeps out of
its timed runs (issue 31)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import mlx.core as mx
from typer.testing import CliRunner

from mtpkit.bench import speed
from mtpkit.bench.speed import prompt_of_length
from mtpkit.cli.app import app

runner = CliRunner()


def test_a_prompt_of_n_tokens_repeats_the_real_one_or_draws_synthetic_ids() -> None:
    real = [5, 6, 7]
    assert prompt_of_length(real, 8) == [5, 6, 7, 5, 6, 7, 5, 6]
    assert prompt_of_length(real, 2) == [5, 6]
    synthetic = prompt_of_length(real, 4096, vocab=300, seed=1)
    assert len(synthetic) == 4096 and all(0 <= t < 300 for t in synthetic)
    assert len(set(synthetic)) > 200  # random ids, not the prompt repeated
    assert synthetic == prompt_of_length(real, 4096, vocab=300, seed=1)  # seeded


def test_bench_decodes_after_the_context_asked_with_the_collector_off(
    converted: Path, monkeypatch
) -> None:
    """--prompt-tokens sets the prompt's length the JSON reports; every timed run (stock,
    --no-mtp, each MTP configuration) runs with Python's collector off, and it is on again
    after bench."""
    collector_on: list[bool] = []
    stock_run, mtp_run = speed.stock_run, speed.mtp_run

    def stock(*args, **kwargs):
        collector_on.append(gc.isenabled())
        return stock_run(*args, **kwargs)

    def mtp(*args, **kwargs):
        collector_on.append(gc.isenabled())
        return mtp_run(*args, **kwargs)

    monkeypatch.setattr(speed, "stock_run", stock)
    monkeypatch.setattr(speed, "mtp_run", mtp)
    args = ["bench", "--model", str(converted), "--prompt-tokens", "300", "--trials", "1"]
    result = runner.invoke(app, [*args, "--max-tokens", "8", "--depth", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_tokens"] == 300
    warm_ups = 1 + 3 + 1  # stock, each depth to AUTO_MAX_DEPTH, adaptive drafting
    timed = collector_on[warm_ups:]
    # stock, --no-mtp, depth 1, adaptive, stock again at the trial's end
    assert len(timed) == 2 + 2 + 1 and not any(timed)
    assert gc.isenabled()


def test_prompt_tokens_below_one_is_a_usage_error() -> None:
    result = runner.invoke(app, ["bench", "--model", "m", "--prompt-tokens", "0"])
    assert result.exit_code == 2


def test_an_untimed_trial_first_is_left_out_of_the_figures(converted: Path) -> None:
    """What a GPU runs by default (first-use kernel builds kept out of the trials): one whole
    trial of every configuration first, its figures not counted."""
    lines: list[str] = []
    result = speed.bench(converted, max_tokens=6, max_depth=1, trials=2, repeats=2,
                         acceptances=[1.0], progress=lines.append, warm_trial=True)  # fmt: skip
    untimed = [line for line in lines if line.startswith("untimed trial:")]
    # stock, --no-mtp, depth 1, adaptive drafting and stock again; the same in each counted trial
    assert len(untimed) == 5
    assert sum(line.startswith("trial ") for line in lines) == 2 * len(untimed)
    report = result.to_json()
    assert report["trials"] == 2
    assert all(len(run.decode_tps.values) == 2 for run in result.runs)
    assert all(run.acceptances == [1.0, 1.0] for run in result.runs)


def test_runs_from_the_prompt_prefilled_once_decode_what_a_whole_prefill_decodes(
    converted: Path, monkeypatch
) -> None:
    """Every bench run continues from forks of one prefill (`Prefilled`): stock mlx-lm fed
    only the prompt's last token on a forked cache, and mtpkit's decoder on forked caches and
    a forked head, give the greedy tokens stock mlx-lm gives from the whole prompt (a
    gated-delta-net hybrid: recurrent states and KV caches both forked), run after run (no
    run's writes reach the prefilled state)."""
    import mlx_lm

    from mtpkit.bench.prefilled import Prefilled
    from mtpkit.runtime.model import load_model
    from mtpkit.speculative.proposers import default_proposer

    m = load_model(converted)
    # The tokenizer is shared by every load of the directory: its EOS comes back after the test.
    monkeypatch.setattr(m.tokenizer, "eos_token_ids", [])
    prompt = prompt_of_length(m.tokenizer.encode("The hash table maps keys to values."), 300)
    stock, stock_tokenizer = speed.stock_load(m)
    monkeypatch.setattr(stock_tokenizer, "eos_token_ids", [])
    whole = speed.stock_tokens(stock, stock_tokenizer, prompt, 12)

    prefilled = Prefilled(m, prompt)
    for _ in range(2):
        cache = prefilled.stock_cache(stock)
        assert cache is not None
        offsets = [c.offset for c in cache if hasattr(c, "offset")]  # the KV caches
        assert offsets and all(o == len(prompt) - 1 for o in offsets)
        fed = mlx_lm.stream_generate(
            stock, stock_tokenizer, mx.array(prompt[-1:]), max_tokens=12, prompt_cache=cache
        )
        assert [r.token for r in fed] == whole
    for depth in (1, 3, 1):
        state = prefilled.mtp_state("mtp", lambda: default_proposer(m))
        assert state is not None and state[2] == len(prompt) - 2  # one token left to prefill
        _, _, decoder = speed.mtp_run(m, prompt, depth, 12, state=state)
        assert decoder.confirmed[:12] == whole
        assert decoder.stats.rounds > 0  # the head drafted from its forked state


def test_nothing_is_prefilled_once_where_ranks_decode_in_lockstep(converted: Path) -> None:
    from mtpkit.bench.prefilled import Prefilled
    from mtpkit.runtime.model import load_model

    m = load_model(converted)
    assert Prefilled(m, [1, 2, 3], enabled=False).stock_cache(m.model) is None
    assert Prefilled(m, [1]).mtp_state("mtp", lambda: None) is None  # nothing to prefill
    assert Prefilled(m, [1, 2]).mtp_state("mtp", lambda: None) is None
