"""The Python API as a newcomer from mlx-lm uses it: `import mtpkit` lists its names,
`engine.tokenizer` is the tokenizer, `mtpkit.generate(engine, "text")` means what
`mlx_lm.generate(model, tokenizer, "text")` means (the text as it stands) and takes `verbose`
and `sampler` as it does (or says why not); and generate's `--extra-eos-token A B`, mlx-lm's
form. Each against stock mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

import mlx_lm
import pytest
from typer.testing import CliRunner

import mtpkit
from mtpkit.cli.app import app
from mtpkit.cli.commands.generate import spread_extra_eos
from mtpkit.runtime.model import GenerateError
from tests.test_chat import QWEN3_STYLE

PROMPT = "Create a new event loop. You"


@pytest.fixture(scope="module")
def engine(converted: Path) -> mtpkit.Engine:
    return mtpkit.load(converted)


def test_import_mtpkit_lists_its_api() -> None:
    names = set(dir(mtpkit))
    assert {"load", "generate", "stream_generate", "Engine", "Request", "make_request"} <= names
    assert "Any" not in names and "__version__" in names
    for name in mtpkit.__all__:
        assert getattr(mtpkit, name) is not None


def test_text_is_the_models_input_as_in_mlx_lm(engine: mtpkit.Engine, converted: Path) -> None:
    model, tokenizer = mlx_lm.load(str(converted))
    tokenizer.chat_template = QWEN3_STYLE  # a template mlx-lm's generate does not apply
    original = engine.tokenizer.chat_template  # the loaded tokenizer is shared: put it back
    engine.tokenizer.chat_template = QWEN3_STYLE
    try:
        want = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=24)
        assert mtpkit.generate(engine, PROMPT, max_tokens=24) == want
        assert engine.tokenizer.encode(PROMPT) == tokenizer.encode(PROMPT)
        # chat messages (or chat_template=True) go through the template
        messages = [{"role": "user", "content": PROMPT}]
        templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        want = mlx_lm.generate(model, tokenizer, templated, max_tokens=24)
        assert mtpkit.generate(engine, messages, max_tokens=24) == want
        assert mtpkit.generate(engine, PROMPT, max_tokens=24, chat_template=True) == want
    finally:
        engine.tokenizer.chat_template = original


def test_verbose_prints_mlx_lm_generates_lines(engine, converted, capsys) -> None:
    model, tokenizer = mlx_lm.load(str(converted))
    mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=24, verbose=True)
    theirs = capsys.readouterr().out.splitlines()
    text = mtpkit.generate(engine, PROMPT, max_tokens=24, verbose=True)
    ours = capsys.readouterr().out.splitlines()
    assert ours[: len(theirs) - 3] == theirs[:-3]  # the frame and the text
    assert text in "\n".join(ours)
    for mine, stock in zip(ours[len(theirs) - 3 :], theirs[-3:], strict=False):
        assert mine.split(",")[0] == stock.split(",")[0]  # Prompt: N tokens, Generation: N ...
    assert ours[-1].startswith("MTP: mtp, acceptance ")


def test_sampler_takes_sampling_settings_or_says_why_not(engine: mtpkit.Engine) -> None:
    settings = mtpkit.SamplingSettings(temp=0.8, top_k=20)
    a = mtpkit.generate(engine, PROMPT, max_tokens=16, sampler=settings, seed=3)
    b = mtpkit.generate(engine, PROMPT, max_tokens=16, temp=0.8, top_k=20, seed=3)
    assert a == b
    from mlx_lm.sample_utils import make_sampler

    with pytest.raises(GenerateError, match="sampler= takes an mtpkit.SamplingSettings"):
        mtpkit.generate(engine, PROMPT, sampler=make_sampler(0.8))


def test_extra_eos_token_takes_several_words_as_mlx_lm(converted: Path) -> None:
    assert spread_extra_eos(["--extra-eos-token", "A", "B", "--mtp", "auto"]) == [
        "--extra-eos-token", "A", "--extra-eos-token", "B", "--mtp", "auto",
    ]  # fmt: skip
    base = ["generate", "--model", str(converted), "-p", "def read_config(path):", "-m", "12"]

    def tokens(*args: str) -> list[int]:
        result = CliRunner().invoke(app, [*base, "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["tokens"]

    reference = tokens("--no-mtp")
    late, early = str(reference[8]), str(reference[4])
    want = reference[: reference.index(reference[4])]
    assert tokens("--extra-eos-token", late, early, "--mtp") == want
    assert tokens("--extra-eos-token", late, "--extra-eos-token", early) == want
