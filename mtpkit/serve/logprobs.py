"""Log-probabilities in a response: each emitted token's under the target (with speculative
decoding, from the verify pass that confirmed it), shaped as mlx_lm.server shapes them
(`choices[0].logprobs.content`, an entry per token with its `id`) and as OpenAI's clients
read them (`token`, `logprob`, `bytes`, `top_logprobs`); a text completion carries OpenAI's
legacy lists beside them (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
"""

from __future__ import annotations

from typing import Any

from mtpkit.speculative.logits import TokenLogprob

# (token id, its log-probability and the top others): one per emitted token.
Scored = tuple[int, TokenLogprob]


def _token(tokenizer: Any, token_id: int) -> str:
    """A token's string as mlx_lm.server names it (`convert_ids_to_tokens`)."""
    return str(tokenizer.convert_ids_to_tokens([token_id])[0])


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    token = _token(tokenizer, token_id)
    return {"id": token_id, "token": token, "logprob": logprob, "bytes": list(token.encode())}


def content_entries(tokenizer: Any, scored: list[Scored]) -> list[dict[str, Any]]:
    """`logprobs.content`: one entry per token, its top others most likely first."""
    out = []
    for token_id, lp in scored:
        entry = _entry(tokenizer, token_id, lp.logprob)
        entry["top_logprobs"] = [_entry(tokenizer, i, v) for i, v in lp.top]
        out.append(entry)
    return out


def chat_logprobs(tokenizer: Any, scored: list[Scored]) -> dict[str, Any]:
    return {"content": content_entries(tokenizer, scored)}


def text_logprobs(tokenizer: Any, scored: list[Scored], offset: int = 0) -> dict[str, Any]:
    """A text completion's: mlx_lm.server's `content` and OpenAI's legacy lists; `offset`:
    where this piece's text begins in the completion."""
    entries = content_entries(tokenizer, scored)
    offsets, at = [], offset
    for token_id, _ in scored:
        offsets.append(at)
        at += len(tokenizer.decode([token_id]))
    return {
        "content": entries,
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
