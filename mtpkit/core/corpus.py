"""Text corpora a command reads: `.txt` files (documents separated by blank lines) and
`.jsonl` files (one object a line: `text`, or chat `messages`, or `prompt` + `completion`),
tokenized document by document and read line by line (never a whole file in memory).
`mtpkit train-head` trains on them; `mtpkit convert --draft-vocab` counts their tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import has_chat_template


def check_files(files: Sequence[str], what: str = "training data") -> None:
    """Fail early, before anything loads, on a missing file or an unknown extension."""
    for f in files:
        path = Path(f)
        if path.suffix not in (".txt", ".jsonl"):
            raise MtpkitError(f"{f}: {what} must be .txt or .jsonl files")
        if not path.is_file():
            raise MtpkitError(f"{f}: no such file")


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool) -> list[int]:
    from mtpkit.core.templates import apply_chat_template

    return apply_chat_template(tokenizer, messages, add_generation_prompt=generation)


def end_token(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    return int(eos) if eos is not None else 0


def _jsonl_document(tokenizer: Any, obj: Any, where: str) -> list[int]:
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return encode_text(tokenizer, obj["text"])
    if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
        if has_chat_template(tokenizer):
            return encode_chat(tokenizer, obj["messages"], generation=False)
        return encode_text(tokenizer, "\n".join(str(m.get("content", "")) for m in obj["messages"]))
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        completion = str(obj.get("completion", ""))
        if has_chat_template(tokenizer):
            messages = [
                {"role": "user", "content": obj["prompt"]},
                {"role": "assistant", "content": completion},
            ]
            return encode_chat(tokenizer, messages, generation=False)
        return encode_text(tokenizer, obj["prompt"] + completion)
    raise MtpkitError(f"{where}: each line must be a JSON object with text, messages or prompt")


def file_documents(tokenizer: Any, files: Sequence[str]) -> Iterator[list[int]]:
    """The documents of the files, once, read line by line (never a whole file)."""
    for f in files:
        try:
            with open(f, encoding="utf-8") as stream:
                if f.endswith(".jsonl"):
                    for n, line in enumerate(stream, 1):
                        if line.strip():
                            try:
                                obj = json.loads(line)
                            except json.JSONDecodeError as e:
                                raise MtpkitError(f"{f}:{n}: not JSON: {e}") from None
                            yield _jsonl_document(tokenizer, obj, f"{f}:{n}")
                    continue
                block: list[str] = []
                for line in stream:
                    if line.strip():
                        block.append(line)
                    elif block:
                        yield encode_text(tokenizer, "".join(block).rstrip("\n"))
                        block = []
                if block:
                    yield encode_text(tokenizer, "".join(block).rstrip("\n"))
        except (OSError, UnicodeDecodeError) as e:
            raise MtpkitError(f"cannot read {f}: {e}") from None
