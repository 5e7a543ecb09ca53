"""`mtpkit chat` against mlx_lm.chat's own loop: with a Qwen3-style template (thinking off,
whose rendering of a past answer drops the `<think></think>` block the answer began after),
each turn continues the cache as mlx_lm.chat's does, so the second turn reuses the first's
prompt and answer and decodes the same text as stock mlx-lm; Ctrl-C ends an answer only;
mlx_lm.chat's flags are taken."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mtpkit
from mtpkit.speculative.chat import Conversation, interrupt_ends_answer

# Qwen3's template in what matters here: a thinking-off turn opens with an empty think block,
# which the rendering of a past answer leaves out.
QWEN3_STYLE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)
TURNS = ["Create a new event loop.", "And another?"]


@pytest.fixture(scope="module")
def templated(converted: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = Path(shutil.copytree(converted, tmp_path_factory.mktemp("chat") / "m"))
    path = model / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = QWEN3_STYLE
    path.write_text(json.dumps(config))
    return model


def mlx_lm_chat(path: Path, turns: list[str], max_tokens: int) -> tuple[list[str], list[int]]:
    """mlx_lm.chat's loop: one KV cache for the session, each turn the template applied to
    the new message alone. The answers, and the tokens the cache holds after the first."""
    model, tokenizer = mlx_lm.load(str(path))
    cache = make_prompt_cache(model)
    answers, first = [], []
    for i, text in enumerate(turns):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        answer, tokens = "", list(prompt)
        for r in mlx_lm.stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=max_tokens, prompt_cache=cache
        ):
            answer += r.text
            tokens.append(r.token)
        answers.append(answer)
        if i == 0:
            first = tokens
    return answers, first


def test_chat_reuses_each_turn_as_mlx_lm_chat_keeps_its_cache(templated: Path) -> None:
    out = subprocess.run(
        [str(Path(sys.executable).parent / "mtpkit"), "chat", "--model", str(templated),
         "--max-tokens", "12", "--trust-remote-code", "--prefill-step-size", "64"],
        input="\n".join([*TURNS, "q"]) + "\n", capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answers, first = mlx_lm_chat(templated, TURNS, 12)
    shown = [turn.split("\n[")[0] for turn in out.stdout.split(">> ")[1:-1]]
    assert shown == answers
    summaries = [line for line in out.stdout.splitlines() if "prompt tokens from the cache" in line]
    assert summaries[0].split("; ")[-1].startswith("0/")
    # The first turn's prompt and answer (all but the last token, which the next turn feeds).
    assert summaries[1].split("; ")[-1].split("/")[0] == str(len(first) - 1)
    assert "never runs a checkpoint's own code" in out.stderr


def test_ctrl_c_ends_the_answer_only(templated: Path) -> None:
    engine = mtpkit.load(templated)
    conversation = Conversation(engine, max_tokens=200)
    session = conversation.turn(TURNS[0])
    events = []
    with interrupt_ends_answer(session):
        for event in session:
            events.append(event)
            if len(events) == 2:
                os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends on Ctrl-C
    assert events[-1].finish_reason == "cancelled"
    assert len(events) < 10
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    conversation.remember(session)
    second = conversation.turn(TURNS[1])
    assert "".join(e.text for e in second)  # the conversation goes on
    assert second.stats.cached_tokens > 0


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--xtc-probability", "0.5"], "Error: --xtc-probability: XTC's random cut"),
        (["--pipeline"], "chat runs on one machine"),
    ],
)
def test_mlx_lm_chat_flags_mtpkit_cannot_honour_are_one_line(
    converted: Path, flags: list[str], line: str
) -> None:
    from typer.testing import CliRunner

    from mtpkit.cli.app import app

    result = CliRunner().invoke(app, ["chat", "--model", str(converted), *flags], input="q\n")
    assert result.exit_code in (1, 2), result.output
    assert line in result.stderr
    assert "Traceback" not in result.output
