"""The short prompts `mtpkit check` probes a head with, the `--prompts FILE` reader, and how
a prompt becomes token ids (`encode_prompt`: generate, bench, check and train-head alike).

A mix of prose, code and lists, because heads are good at different things on each (code and
lists are more predictable than prose) and a convention error shows on all of them. They are
continuations rather than instructions, so base models and small ones produce text too. The
paired per-prompt comparison in `probes.py` uses the sixteen built-in prompts, and sixteen
reserve prompts when a comparison is undecided.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtpkit.core.errors import MtpkitError

BUILTIN_PROMPTS: tuple[str, ...] = (
    # prose
    "The history of the printing press begins in the fifteenth century, when",
    "Return a new list containing the items of the sequence for which",
    "Once upon a time, in a small village by the sea, there lived",
    "The report describes how the system handles errors when the network",
    "The committee met on Tuesday to discuss the budget for the next year.",
    "If the timeout argument is given, the call blocks for at most",
    # code
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for (int i = 0; i < n; i++) {\n",
    "SELECT name, count(*) FROM orders WHERE",
    # lists
    "List the days of the week: Monday, Tuesday,",
    "Numbers from one to twenty: 1, 2, 3, 4, 5,",
    "A shopping list:\n- milk\n- eggs\n- bread\n-",
    "The planets of the solar system, in order from the sun, are",
    "Steps to make tea:\n1. Boil water.\n2.",
)


# Measured too when a comparison on the built-in prompts reaches its margin but not
# significance: the same mix, sixteen more paired samples.
RESERVE_PROMPTS: tuple[str, ...] = (
    # prose
    "In the beginning of the twentieth century, the city grew quickly because",
    "This module provides functions for reading and writing files in",
    "The function raises a ValueError if the argument is",
    "A good cup of coffee depends on the water, the beans and",
    "The following example shows how to open a connection to the server and",
    "The object is created when the class is called, and its attributes are",
    # code
    'def read_config(path):\n    """Read the configuration file at path and return',
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "Create a new thread that runs the given function with",
    "while True:\n    line = stream.readline()\n    if not line:\n",
    "Parse the configuration file and return a dictionary that maps",
    # lists
    "Colors of the rainbow: red, orange, yellow,",
    "Months of the year: January, February, March,",
    "Things to pack for a trip:\n- passport\n- tickets\n-",
    "The first ten prime numbers are 2, 3, 5,",
    "Ingredients for pancakes:\n- flour\n- milk\n-",
)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings (`.json`), else blocks separated by blank lines.

    Blank-line separation lets a prompt span lines (code). Raises MtpkitError on an unreadable
    or empty file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MtpkitError(f"cannot read prompts from {path}: {e}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MtpkitError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, list) or not all(isinstance(p, str) for p in data):
            raise MtpkitError(f"{path} must hold a JSON list of strings")
        prompts = [p for p in data if p.strip()]
    else:
        blocks, current = [], []
        for line in text.splitlines():
            if line.strip():
                current.append(line)
            elif current:
                blocks.append("\n".join(current))
                current = []
        if current:
            blocks.append("\n".join(current))
        prompts = blocks
    if not prompts:
        raise MtpkitError(
            f"{path} holds no prompts: write one prompt per paragraph (blank lines between)"
        )
    return prompts


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_messages(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
    template_args: dict[str, Any] | None = None, tools: list[Any] | None = None,
) -> list[int]:  # fmt: skip
    """A conversation's token ids through the tokenizer's chat template (`chat`, the
    server's chat completions); `template_args` go to the template (mlx_lm.server's
    --chat-template-args, e.g. enable_thinking), `tools` are a request's tool definitions.
    Without a template, the messages as one text, as mlx_lm.server renders them."""
    if not has_chat_template(tokenizer):
        from mtpkit.mlxlm import chat_as_text

        return list(tokenizer.encode(chat_as_text(messages)))
    from mtpkit.core.templates import apply_chat_template, template_variables

    return apply_chat_template(
        tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
        **template_variables(template_args or {}),  # `tools` among them is refused by name
    )  # fmt: skip


def encode_prompt(
    tokenizer: Any,
    prompt: str,
    *,
    chat_template: bool = True,
    system_prompt: str | None = None,
    prefill_response: str | None = None,
    template_args: dict[str, Any] | None = None,
) -> list[int]:
    """A generation prompt's token ids: where the tokenizer has a chat template (and
    `chat_template`), the messages as mlx_lm.generate builds them (an optional system prompt,
    the user's prompt, an optional start of the assistant's answer that generation
    continues); else the text, with the tokenizer's special tokens unless the text already
    starts with its BOS."""
    if chat_template and has_chat_template(tokenizer):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        prefill = prefill_response is not None
        if prefill:
            messages.append({"role": "assistant", "content": prefill_response})
        from mtpkit.core.templates import apply_chat_template

        return apply_chat_template(
            tokenizer, messages, add_generation_prompt=not prefill, continue_final_message=prefill,
            **(template_args or {}),
        )
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=add_special))
