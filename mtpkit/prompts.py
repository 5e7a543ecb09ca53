"""The short prompts `mtpkit check` probes a head with, and the `--prompts FILE` reader.

A mix of prose, code and lists, because heads are good at different things on each (code and
lists are more predictable than prose) and a convention error shows on all of them. Sixteen
prompts give the paired per-prompt comparison in `check.py` enough samples to tell a
few-point difference from noise.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtpkit.errors import MtpkitError

BUILTIN_PROMPTS: tuple[str, ...] = (
    # prose
    "The history of the printing press begins in the fifteenth century, when",
    "Write a short paragraph about why the sky is blue.",
    "Once upon a time, in a small village by the sea, there lived",
    "Explain in simple words how a bicycle stays upright while it moves.",
    "The committee met on Tuesday to discuss the budget for the next year.",
    "Summarize the main idea of the theory of evolution in three sentences.",
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
