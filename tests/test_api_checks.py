"""Issue 48, 6 and 8 and the Engine's threads: what the Python API, the CLI and the server
build is checked where it is built (`SamplingSettings.checked`, `check_prompt`, `Engine`);
MLX's random state survives a compiled filter that raises; a template is bounded in time on
any thread."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

import mtpkit.core.templates
from mtpkit.cli.app import app
from mtpkit.core.errors import MtpkitError
from mtpkit.core.templates import ChatTemplateError, apply_chat_template
from mtpkit.speculative.accept import BadSampling, SamplingSettings
from mtpkit.speculative.session import Engine, EngineThreadError, generate

runner = CliRunner()
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def engine(converted: Path) -> Engine:
    return Engine.load(converted, prompt_cache_size=0)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"temp": -1}, "temp"), ({"temp": math.nan}, "temp"), ({"temp": "0.5"}, "temp"),
     ({"top_p": 2}, "top_p"), ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k"),
     ({"top_k": 1.5}, "top_k"), ({"top_k": True}, "top_k"), ({"min_p": 1.5}, "min_p"),
     ({"min_tokens_to_keep": 0}, "min_tokens_to_keep")],
)  # fmt: skip
def test_sampling_settings_are_checked_where_they_are_built(fields, named) -> None:
    """Before: temp -1 sampled the inverted distribution, NaN and top_p 2 decoded anyway."""
    with pytest.raises(BadSampling, match=f"^{named} "):
        SamplingSettings.checked(**fields)


def test_top_k_of_the_vocabulary_or_more_keeps_every_token() -> None:
    """numpy's softmax of the logits is the distribution either way (mlx-lm's filter refuses
    a top_k past the vocabulary)."""
    logits = mx.array(np.random.default_rng(0).normal(size=(1, 100)).astype(np.float32))
    expected = np.exp(np.array(logits) / 0.8)
    expected /= expected.sum()
    for top_k in (100, 5000, 2**63):
        sampling = SamplingSettings.checked(temp=0.8, top_k=top_k, vocab_size=100)
        assert sampling.top_k == 0
        np.testing.assert_allclose(np.array(sampling.probs(logits)), expected, rtol=1e-5)
    assert SamplingSettings.checked(temp=0.8, top_k=99, vocab_size=100).top_k == 99


def test_a_failed_compiled_filter_leaves_mlx_random_state_usable() -> None:
    """mlx-lm's compiled apply_top_k raises for top_k past the vocabulary while MLX's random
    state is traced: before, every later draw failed with "Attempting to eval an array
    without a primitive"."""
    unchecked = SamplingSettings(temp=0.8, top_k=5000)  # bypasses `checked` on purpose
    logits = mx.zeros((1, 100))
    with pytest.raises(ValueError, match="top_k"):
        unchecked.probs(logits)
    with pytest.raises(ValueError, match="top_k"):
        mx.eval(unchecked.sampler()(logits))
    draw = mx.random.uniform(shape=(3,))
    mx.eval(draw)
    assert draw.shape == (3,)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "expected"),
    [([3, 5000], {}, "token id 5000 is not in the model's vocabulary (0..1023)"),
     ([-1, 2], {}, "token id -1 is not in the model's vocabulary"),
     (b"ab", {}, "the prompt must be text, token ids or chat messages, not bytes"),
     ([1, "2"], {}, "holds '2', not an integer id"),
     ([1, 2], {"temp": -1}, "temp must be 0"), ([1, 2], {"top_p": 2}, "top_p must be"),
     ([1, 2], {"top_k": -3}, "top_k must be"), ([1, 2], {"seed": -1}, "the seed must be")],
)  # fmt: skip
def test_the_python_api_refuses_what_the_cli_and_server_refuse(engine, prompt, kwargs, expected):
    """Before: [3, 5000] on a 1024-token model decoded text read past the embedding."""
    with pytest.raises(MtpkitError) as raised:
        generate(engine, prompt, max_tokens=2, **kwargs)
    assert expected in str(raised.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"prompt_cache_size": "10"}, "prompt_cache_size"), ({"max_kv_size": 0}, "max_kv_size")],
)
def test_engine_counts_are_checked_at_construction(engine, kwargs, named) -> None:
    with pytest.raises(MtpkitError, match=f"^{named} must be an integer"):
        Engine(engine.m, **kwargs)


def test_an_engine_decodes_on_one_thread(engine) -> None:
    """Before: an engine shared by four threads segfaulted in one run of three, two threads
    failed a call with a bare MLX RuntimeError. Now the second thread is told, and the first
    keeps decoding."""
    first = generate(engine, [1, 2, 3], max_tokens=3)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            generate(engine, [1, 2, 3], max_tokens=3)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors.append(e)

    thread = threading.Thread(target=other, name="worker-2")
    thread.start()
    thread.join(60)
    assert len(errors) == 1 and isinstance(errors[0], EngineThreadError)
    assert "'worker-2'" in str(errors[0]) and "one thread" in str(errors[0])
    assert generate(engine, [1, 2, 3], max_tokens=3) == first


def test_generate_cli_top_k_past_the_vocabulary_and_seed_overflow(converted) -> None:
    """Before: `--temp 1 --top-k 5000` and two prompts with seed 2**64-1 (row i draws from
    seed + i) ended in "unexpected ..."."""
    base = ["generate", "--model", str(converted), "-m", "2", "--verbose", "False"]
    result = runner.invoke(app, [*base, "-p", "x", "--temp", "1", "--top-k", "5000"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, [*base, "-p", "A", "-p", "B", "--seed", str(2**64 - 1)])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: the seed must be an integer from 0 to 2**64 - 1, not {2**64}"
    ]


class _Tokenizer:
    special_tokens_map: dict = {}

    def __init__(self, template: object) -> None:
        self.chat_template = template

    def apply_chat_template(self, *args: object, **kwargs: object) -> list[int]:
        raise AssertionError("an unbounded render was reached")


def test_a_looping_template_is_stopped_off_the_main_thread(monkeypatch) -> None:
    """The server renders on its encoding thread, where SIGALRM never fired: two nested
    range(100000) loops held it (and every later request) for hours."""
    monkeypatch.setattr(mtpkit.core.templates, "MAX_SECONDS", 1.0)
    outcome: list[object] = []

    def render() -> None:
        start = time.monotonic()
        try:
            apply_chat_template(_Tokenizer(LOOPS), [{"role": "user", "content": "x"}])
        except ChatTemplateError as e:
            outcome.extend([str(e), time.monotonic() - start])

    thread = threading.Thread(target=render)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert outcome and "ran longer than 1 seconds" in outcome[0] and outcome[1] < 5


@pytest.mark.parametrize(
    ("template", "expected"),
    [("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
     ({"default": 5}, "is int, not text"), (["x"], "is list, not text")],
)  # fmt: skip
def test_a_recursive_or_non_text_template_is_one_error(template, expected) -> None:
    """Before: a RecursionError traceback; a non-string template "Can't compile non template
    nodes"."""
    with pytest.raises(ChatTemplateError, match=expected):
        apply_chat_template(_Tokenizer(template), [{"role": "user", "content": "x"}])
