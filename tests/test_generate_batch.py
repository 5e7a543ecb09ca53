"""`mtpkit generate -p A -p B ...`: several prompts decoded together, each request's tokens
those the same prompt gives alone with stock mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

import mlx_lm
import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.speculative.batch.generate import generate_batch
from tests.stock import stock_tokens

# Prompts of different lengths: rows join at different cache offsets.
PROMPTS = ["Create a new event loop. You", "hello", "Return a new list of the items in the"]


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def prompt_ids(path: Path, text: str) -> list[int]:
    _, tokenizer = mlx_lm.load(str(path))
    return tokenizer.encode(text)


@pytest.mark.parametrize("mtp", ["--mtp", "--no-mtp", "--prompt-lookup", "--draft-model"])
def test_each_request_is_its_prompt_alone(converted: Path, mtp: str) -> None:
    """Greedy, with the head (rows accepting on their own), by prompt lookup (each row's own
    n-grams), by a draft model (each row's own draft caches; here the model itself) and
    without a drafter (stock's batch_generate): every request's tokens are stock mlx-lm's
    for its prompt alone."""
    args = [a for p in PROMPTS for a in ("-p", p)]
    extra = {"--prompt-lookup": ["--prompt-lookup-min", "1"], "--draft-model": [str(converted)]}
    result = run("generate", "--model", str(converted), *args, "-m", "20", mtp,
                 *extra.get(mtp, []), "--no-chat-template", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["batch"] == 3 and out["mtp"] is (mtp != "--no-mtp")
    drafter = {"--mtp": "mtp", "--no-mtp": "none", "--prompt-lookup": "prompt-lookup",
               "--draft-model": "draft-model"}[mtp]  # fmt: skip
    assert out["drafter"] == drafter
    for prompt, request in zip(PROMPTS, out["requests"], strict=True):
        expected = stock_tokens(converted, prompt_ids(converted, prompt), 20)
        assert request["tokens"] == expected, prompt
        assert request["prompt_tokens"] == len(prompt_ids(converted, prompt))
        assert request["finish_reason"] == ("length" if len(expected) == 20 else "stop")
    if mtp != "--no-mtp":
        assert sum(r["drafted"] for r in out["requests"]) > 0
        assert out["decode_tps"] > 0


def test_prints_each_text_then_the_batch(converted: Path) -> None:
    result = run("generate", "--model", str(converted), "-p", PROMPTS[0], "-p", PROMPTS[1],
                 "-m", "12", "--no-chat-template")  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "========== [1/2]"
    assert "========== [2/2]" in lines
    assert any(line.startswith("Generation: ") and "(2 requests)" in line for line in lines)
    assert lines[-1].startswith("MTP: batch of 2, acceptance ")
    quiet = run("generate", "--model", str(converted), "-p", PROMPTS[0], "-p", PROMPTS[1],
                "-m", "12", "--no-chat-template", "--verbose", "False")  # fmt: skip
    texts = [r.text for r in generate_batch(converted, PROMPTS[:2], max_tokens=12,
                                            chat_template=False).results]  # fmt: skip
    assert quiet.stdout == "".join(t + "\n" for t in texts)


def test_a_seeded_request_samples_the_same_in_any_batch(converted: Path) -> None:
    """Request i samples with seed + i from its own key: its tokens are the same alone
    (a batch of one, seed + i) as beside others."""
    kwargs = {"max_tokens": 16, "temp": 1.0, "chat_template": False}
    together = generate_batch(converted, PROMPTS, seed=7, **kwargs).results
    alone = generate_batch(converted, [PROMPTS[2]], seed=9, **kwargs).results
    assert together[2].tokens == alone[0].tokens
    assert generate_batch(converted, PROMPTS, seed=7, **kwargs).results[0].tokens == (
        together[0].tokens
    )


def test_one_stream_options_are_usage_errors(converted: Path) -> None:
    cases = [
        (["--xtc-probability", "0.5"], "--xtc-probability works on one prompt"),
        (["--max-kv-size", "64"], "--max-kv-size works on one prompt"),
        (["--kv-bits", "4"], "--kv-bits works on one prompt"),
        (["-p", "-"], None),  # one stdin prompt among several is fine
    ]
    for args, message in cases:
        result = run("generate", "--model", str(converted), "-p", "a", "-p", "b", *args,
                     "-m", "2", input="from stdin")  # fmt: skip
        if message is None:
            assert result.exit_code == 0, result.output
            continue
        assert result.exit_code == 2, result.output
        assert message in result.stderr.splitlines()[-1]
    twice = run("generate", "--model", str(converted), "-p", "-", "-p", "-", input="x")
    assert twice.exit_code == 2
    assert "reads standard input once" in twice.stderr.splitlines()[-1]


def test_a_bad_prompt_is_named_by_its_place(converted: Path) -> None:
    result = run("generate", "--model", str(converted), "-p", "a", "-p", "", "--no-chat-template")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == ["Error: prompt 2 of 2: the prompt is empty"]


def test_escapes_are_read_in_every_prompt_and_the_note_comes_once(converted: Path) -> None:
    """\\n in each of several prompts is a newline, as mlx_lm.generate reads one prompt's;
    --trust-remote-code's note is printed once."""
    from mtpkit.cli.options import REMOTE_CODE_NOTE

    result = run("generate", "--model", str(converted), "-p", "def f(x):\\n    return", "-p",
                 "a\\tb", "-m", "4", "--no-chat-template", "--json", "--trust-remote-code")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.count(REMOTE_CODE_NOTE) == 1
    requests = json.loads(result.stdout)["requests"]
    expected = [len(prompt_ids(converted, p)) for p in ("def f(x):\n    return", "a\tb")]
    assert [r["prompt_tokens"] for r in requests] == expected
