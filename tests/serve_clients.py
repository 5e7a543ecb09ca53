"""The model the client tests serve: the bundled example converted, with a chat template in
its tokenizer config that renders tools, tool calls, tool results and names (mlx-lm infers
its `json_tools` parser from it, `<tool_call>` and `tool_call.name`), so that mtpkit serve
and mlx_lm.server read the same template from the same directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Answer with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}{% set tool_call = tc.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}"
    "{%- if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# What the model "says" when it calls the tool (see `calling_model`).
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def templated_model(converted: Path, out: Path) -> Path:
    """A copy of `converted` whose tokenizer config carries TOOLS_TEMPLATE."""
    shutil.copytree(converted, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    return out


def _byte_level(text: str) -> str:
    """`text` in a byte-level BPE vocabulary's alphabet (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in text.encode())


def calling_model(converted: Path, out: Path) -> Path:
    """`templated_model`, with the token the tiny model answers any chat with (".", id 16)
    renamed in its vocabulary to a whole tool call: its greedy answer is then a call, which
    each server's tool parser finds in the text as it would in a real model's. Nothing else
    changes: the weights are the same, and "." (no longer in the vocabulary) stays out of the
    tests' prompts."""
    templated_model(converted, out)
    path = out / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    assert vocab.pop(".") == 16
    vocab[_byte_level(CALL)] = 16
    tokenizer["model"]["merges"] = [
        m
        for m in tokenizer["model"]["merges"]
        if "." not in (m.split(" ") if isinstance(m, str) else m)
    ]
    path.write_text(json.dumps(tokenizer))
    return out
