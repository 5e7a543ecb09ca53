"""The decoding session and the Python API (`mtpkit.load`, `generate`, `stream_generate`),
`mtpkit chat`, and generate's mlx-lm habits that the session changed (the seed before
loading, the EOS counted, no warm-up), each against stock mlx-lm run independently."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

import mtpkit
from mtpkit.speculative.session import Request

PROMPT = "Create a new event loop. You"


def stock_greedy(path: Path, tokens: list[int], n: int) -> list[int]:
    return stock_text(path, tokens, n)[0]


def stock_text(path: Path, tokens: list[int], n: int) -> tuple[list[int], str]:
    """Stock mlx-lm's greedy tokens (up to an EOS) and its streamed text."""
    model, tokenizer = mlx_lm.load(str(path))
    out, text = [], ""
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(tokens), max_tokens=n):
        text += r.text
        if r.finish_reason == "stop" and r.token in tokenizer.eos_token_ids:
            break
        out.append(r.token)
    return out, text


@pytest.fixture(scope="module")
def engine(converted: Path) -> mtpkit.Engine:
    return mtpkit.load(converted)


def test_the_api_decodes_stock_greedy_tokens(engine: mtpkit.Engine, converted: Path) -> None:
    tokens = engine.m.tokenizer.encode(PROMPT)
    events = list(mtpkit.stream_generate(engine, tokens, max_tokens=40))
    reference, text = stock_text(converted, tokens, 40)
    assert [e.token for e in events if e.token is not None] == reference
    assert events[-1].finish_reason in ("stop", "length")
    assert "".join(e.text for e in events) == text
    assert any(e.from_draft for e in events)  # the head drafted and was kept
    assert mtpkit.generate(engine, tokens, max_tokens=40) == text


def test_a_prompt_that_extends_a_cached_one_prefills_only_what_it_adds(
    engine: mtpkit.Engine, converted: Path
) -> None:
    """Same prompt again: all but its last token from the cache; a conversation's next turn
    (prompt + answer + more): the first turn's whole state reused. Every output is stock's."""
    engine.prompt_cache.clear()
    first = engine.m.tokenizer.encode("def main():\n    x")
    s1 = engine.session(Request(first, max_tokens=12))
    out1 = [e.token for e in s1 if e.token is not None]
    assert s1.stats.cached_tokens == 0
    s2 = engine.session(Request(first, max_tokens=12))
    assert [e.token for e in s2 if e.token is not None] == out1
    assert s2.stats.cached_tokens == len(first) - 1
    second = first + s2.decoder.confirmed + engine.m.tokenizer.encode(" = 3")
    s3 = engine.session(Request(second, max_tokens=12))
    out3 = [e.token for e in s3 if e.token is not None]
    assert s3.stats.cached_tokens >= len(first) + len(out1) - 1
    assert out3 == stock_greedy(converted, second, 12)


def test_stop_strings_end_the_text_before_them(engine: mtpkit.Engine, converted: Path) -> None:
    tokens = engine.m.tokenizer.encode(PROMPT)
    full = stock_text(converted, tokens, 40)[1]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    session = engine.session(Request(tokens, max_tokens=40, stop=(stop, "never here")))
    text = "".join(e.text for e in session)
    assert text == full[: full.index(stop)]
    assert session.finish_reason == "stop"


def test_the_api_names_are_exported() -> None:
    assert {"load", "generate", "stream_generate", "Engine", "Request"} <= set(mtpkit.__all__)
    with pytest.raises(AttributeError):
        mtpkit.no_such_name  # noqa: B018


def test_chat_keeps_the_cache_between_turns(converted: Path) -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "mtpkit"), "chat", "--model", str(converted),
         "--max-tokens", "12"],
        input="Create a new event loop.\nAnd another?\nq\n", capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    summaries = [line for line in out.stdout.splitlines() if "prompt tokens from the cache" in line]
    assert len(summaries) == 2
    assert summaries[0].endswith("; 0/" + summaries[0].split("; 0/")[1])  # nothing cached yet
    reused = int(summaries[1].split("; ")[-1].split("/")[0])
    assert reused > 0


def _cli(*args: str) -> str:
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_seed_and_generation_count_as_mlx_lm_generate(converted: Path) -> None:
    """`--no-mtp --seed S` samples what `mlx_lm.generate --seed S` samples (both seed before
    loading), and `Generation:` counts the EOS as mlx-lm's does."""
    bin_dir = Path(sys.executable).parent
    common = ["--model", str(converted), "--prompt", PROMPT, "--max-tokens", "40"]
    sampled = ["--temp", "0.9", "--seed", "11"]
    ours = _cli(str(bin_dir / "mtpkit"), "generate", *common, *sampled, "--no-mtp")
    theirs = _cli(sys.executable, "-m", "mlx_lm", "generate", *common, *sampled)
    assert ours.split("==========")[1] == theirs.split("==========")[1]
    ours = _cli(str(bin_dir / "mtpkit"), "generate", *common)  # greedy: ends at an EOS
    theirs = _cli(sys.executable, "-m", "mlx_lm", "generate", *common)
    count = [line.split(",")[0] for line in ours.splitlines() if line.startswith("Generation:")]
    assert count == [
        line.split(",")[0] for line in theirs.splitlines() if line.startswith("Generation:")
    ]


def test_a_head_that_never_drafts_right_is_named(converted: Path, tmp_path: Path) -> None:
    """A head full of NaN drafts garbage that is never kept: one warning says so."""
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    sidecar = broken / "mtp" / "weights.safetensors"
    weights = mx.load(str(sidecar))
    nan = {
        k: (v * mx.nan if mx.issubdtype(v.dtype, mx.floating) else v) for k, v in weights.items()
    }
    mx.save_safetensors(str(sidecar), nan, metadata={"format": "mlx"})
    out = subprocess.run(
        [str(Path(sys.executable).parent / "mtpkit"), "generate", "--model", str(broken),
         "--prompt", PROMPT, "--max-tokens", "48", "--depth", "2",
         "--no-adaptive", "--mtp"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "none was accepted" in line]
    assert len(warnings) == 1 and "mtpkit check" in warnings[0]


def test_generate_decodes_once_with_no_warm_up(
    converted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate` prefills the prompt once: no untimed warm-up decodes first (they made it
    start ~0.5 s after mlx_lm.generate on a tiny model)."""
    from mtpkit.speculative.decode import MtpDecoder
    from mtpkit.speculative.generate import generate

    prefills = []
    original = MtpDecoder.prefill
    monkeypatch.setattr(
        MtpDecoder, "prefill", lambda self, *a: prefills.append(1) or original(self, *a)
    )
    generate(converted, PROMPT, max_tokens=8, chat_template=False)
    assert len(prefills) == 1


def test_a_seed_out_of_range_is_one_error_from_python(converted: Path) -> None:
    """The Python API refuses what the command line refuses (issue 32, item 5)."""
    from mtpkit.core.errors import MtpkitError
    from mtpkit.speculative.generate import generate

    for seed in (-1, 2**64, 1.5):
        with pytest.raises(MtpkitError, match="the seed must be an integer"):
            generate(converted, PROMPT, max_tokens=4, seed=seed)  # type: ignore[arg-type]


def test_chat_samples_with_min_tokens_to_keep_as_stock(converted: Path) -> None:
    """Issue 43: `--min-tokens-to-keep` reaches chat's sampler. At min-p 1.0 only the top
    token survives min-p's filter unless more are kept: with 40 kept, chat's seeded answer is
    stock mlx-lm's with the same sampler and seed (and not the one keeping 1)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler
    from typer.testing import CliRunner

    from mtpkit.cli.app import app
    from mtpkit.core.prompts import encode_messages

    message = "Create a new event loop."
    args = ["chat", "--model", str(converted), "--max-tokens", "12", "--no-mtp", "--temp", "1",
            "--min-p", "1.0", "--min-tokens-to-keep", "40", "--seed", "3"]  # fmt: skip
    result = CliRunner().invoke(app, args, input=f"{message}\nq\n")
    assert result.exit_code == 0, result.output
    answer = result.stdout.split(">> ")[1].split("\n[plain decoding")[0]
    model, tokenizer = mlx_lm.load(str(converted))
    ids = mx.array(encode_messages(tokenizer, [{"role": "user", "content": message}]))

    def stock(keep: int) -> str:
        mx.random.seed(3)
        sampler = make_sampler(1.0, min_p=1.0, min_tokens_to_keep=keep)
        pieces = mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=12, sampler=sampler)
        return "".join(r.text for r in pieces)

    assert answer == stock(40) and answer != stock(1)
