"""What `mtpkit train-head` trains on: token chunks of a fixed length, streamed.

Two sources, one stream of documents (token lists) each:
- self-generated (the default, offline): a model with a chat template samples answers to a
  prompt set (`TRAIN_PROMPTS`, or `--prompts FILE`); a base model writes unconditioned text
  after its end-of-text token (and on past the ones it writes), packed into one stream so
  that chunks start mid-document.
  A head distilled on the model's own text learns exactly the distribution it will draft for.
- the user's files: `.txt` (documents separated by blank lines) and `.jsonl` (one object a
  line: `text`, or chat `messages`, or `prompt` + `completion`), read lazily.

Documents are tokenized, ended with the end-of-text token and packed into chunks of
`seq_len` tokens. File corpora are streamed through a bounded shuffle buffer and cycled, so
memory does not grow with the corpus; the generated pool is small (token ids only). Only token
ids are ever kept: the backbone's hidden states are recomputed for every batch.

The stream is a pure function of the seed, so a resumed run skips the chunks it consumed
(`ChunkStream.skip`) and sees the same batches an uninterrupted run would.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mtpkit.core.corpus import end_token, file_documents
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt, has_chat_template

# Prompts the default self-generated corpus starts from: a spread of prose, code and lists,
# none of them among `mtpkit.core.prompts`' (what `check` measures acceptance on).
TRAIN_PROMPTS: tuple[str, ...] = (
    "The museum opened its new wing last spring, and visitors",
    "Return the number of elements in the container. If the container is empty,",
    "She walked along the river until the path turned toward the hills, where",
    "This class implements a simple cache that stores the results of",
    "Write a short explanation of how a hash table works.",
    "The weather in the mountains changes quickly, so hikers should",
    "Raise an exception if the file does not exist or cannot be",
    "The main difference between a list and a tuple is that",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "import json\n\n\ndef load(path):\n",
    "class Queue:\n    def __init__(self):\n",
    "def is_prime(n):\n",
    'if __name__ == "__main__":\n',
    "Explain what the following function does and when it returns None.",
    "Fruits that grow in warm climates include mangoes, papayas,",
    "The train left the station at seven, and by noon it had",
    "Set the value of the attribute to the given object. The attribute is",
    "An introduction to the rules of chess: each player begins with",
    "The steps of the scientific method are: 1. Ask a question. 2.",
    "Convert the string to lower case and strip any leading or trailing",
    "A recipe for bread:\n1. Mix flour, water and yeast.\n2.",
    "The library provides tools for working with dates, times and",
    "Compute the checksum of the data and compare it with the value",
    "Once the server receives the request, it",
)


@dataclass(frozen=True)
class DataSpec:
    """Where the text comes from: generated (`files` empty) or the user's files."""

    files: tuple[str, ...] = ()
    # None: `TRAIN_PROMPTS` for a model with a chat template, else unconditioned text.
    prompts: tuple[str, ...] | None = None
    # None: enough for every chunk of the run to be new (steps x batch size / prompts).
    samples_per_prompt: int | None = None
    temperature: float = 0.7
    chat_template: bool = True

    def describe(self) -> dict[str, Any]:
        if self.files:
            return {"source": "files", "files": list(self.files)}
        return {
            "source": "self_generated",
            "prompts": "auto" if self.prompts is None else len(self.prompts),
            "samples_per_prompt": self.samples_per_prompt or "auto",
            "temperature": self.temperature,
        }


# --------------------------------------------------------------------------- generating


def sample_continuations(
    model: Any, prompt: list[int], *, count: int, max_tokens: int, temperature: float
) -> list[list[int]]:
    """`count` continuations of one prompt, in one batch (the prompt is the same in every
    row, so no padding); temperature 0 makes them all greedy.

    Odd rows sample at `temperature` throughout: the model's own spread, which sampled
    drafting meets. Even rows sample their first few tokens (1 up to half the length,
    spread over the rows) and continue greedily: the states greedy drafting meets, reached
    from many starting points rather than from the prompt alone.
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt] * count), cache=cache)[:, -1]
    rows = mx.arange(count)
    switch = mx.where(rows % 2 == 0, 1 + (rows * max(max_tokens // 2, 1)) // count, max_tokens)
    out: list[mx.array] = []
    for j in range(max_tokens):
        greedy = mx.argmax(logits, axis=-1)
        if temperature > 0:
            sampled = mx.random.categorical(logits.astype(mx.float32) * (1 / temperature))
            greedy = mx.where(switch > j, sampled, greedy)
        out.append(greedy)
        logits = model(greedy[:, None], cache=cache)[:, -1]
        mx.eval(logits, greedy)
    return mx.stack(out, axis=1).tolist() if out else [[] for _ in range(count)]


def cut_at_end(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def eos_ids(tokenizer: Any) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    return {int(i) for i in ids} if ids else {end_token(tokenizer)}


def generate_pool(
    model: Any,
    tokenizer: Any,
    spec: DataSpec,
    *,
    length: int,
    seed: int,
    chunks: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """The self-generated corpus, enough for the run's `chunks` to be new by default.

    A model without a chat template (a base model) writes unconditioned text
    (`unconditioned_pool`). With a chat template, or `--prompts`, it answers the prompts:
    prompt + continuation up to its first end-of-text token (at most `length` tokens in all).
    """
    mx.random.seed(seed)
    if spec.prompts is None and not has_chat_template(tokenizer):
        count = spec.samples_per_prompt or -(-chunks // UNCONDITIONED_CHUNKS)
        return unconditioned_pool(model, tokenizer, count, length, spec, progress)
    prompts = spec.prompts or TRAIN_PROMPTS
    per_prompt = spec.samples_per_prompt or max(1, -(-chunks // len(prompts)))
    eos = eos_ids(tokenizer)
    pool = []
    for i, text in enumerate(prompts):
        prompt = encode_prompt(tokenizer, text, chat_template=spec.chat_template)[: length - 1]
        rows = sample_continuations(
            model,
            prompt,
            count=per_prompt,
            max_tokens=length - len(prompt),
            temperature=spec.temperature,
        )
        pool.extend(prompt + cut_at_end(row, eos) for row in rows)
        if progress is not None:
            progress(i + 1, len(prompts))
    return pool


# An unconditioned sample is this many chunks long, so chunks start mid-document.
UNCONDITIONED_CHUNKS = 3


def unconditioned_pool(
    model: Any,
    tokenizer: Any,
    count: int,
    length: int,
    spec: DataSpec,
    progress: Callable[[int, int], None] | None = None,
    batch: int = 64,
) -> list[list[int]]:
    """`count` samples of `UNCONDITIONED_CHUNKS` x `length` tokens the model writes after its
    end-of-text token (the leading one not kept).

    A sample runs on past the end-of-text tokens the model writes: what follows is the next
    document of the model's own stream, so every generated token is kept. (A sample cut at its
    first end-of-text token kept about 60 of its 384 tokens on the example, where the median
    document is about 30 tokens: the run's chunks repeated the pool six times over.)
    """
    pool: list[list[int]] = []
    while len(pool) < count:
        rows = sample_continuations(
            model,
            [end_token(tokenizer)],
            count=min(batch, count - len(pool)),
            max_tokens=UNCONDITIONED_CHUNKS * length,
            temperature=spec.temperature,
        )
        pool.extend(rows)
        if progress is not None:
            progress(len(pool), count)
    return pool


def greedy_sequences(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, max_tokens: int, chat_template: bool
) -> list[tuple[list[int], int]]:
    """(prompt + the backbone's greedy continuation, prompt length) for each prompt: what a
    drafting run would verify, for the held-out acceptance (its length)."""
    out = []
    for text in prompts:
        prompt = encode_prompt(tokenizer, text, chat_template=chat_template)
        rows = sample_continuations(model, prompt, count=1, max_tokens=max_tokens, temperature=0.0)
        out.append((prompt + rows[0], len(prompt)))
    return out


# --------------------------------------------------------------------------- chunking


def pack(documents: Iterator[list[int]], length: int, end: int) -> Iterator[list[int]]:
    """Documents, each followed by `end` unless it ends with it, in chunks of `length`."""
    buffer: list[int] = []
    for doc in documents:
        buffer.extend(doc)
        if not doc or doc[-1] != end:
            buffer.append(end)
        while len(buffer) >= length:
            yield buffer[:length]
            buffer = buffer[length:]


class ChunkStream:
    """An endless, seeded stream of `length`-token chunks: the generated pool reshuffled
    every epoch, or the files cycled through a shuffle buffer of `buffer` chunks."""

    def __init__(
        self,
        *,
        length: int,
        seed: int,
        end: int,
        pool: list[list[int]] | None = None,
        tokenizer: Any = None,
        files: Sequence[str] = (),
        buffer: int = 256,
    ) -> None:
        self.length, self.seed, self.end, self.buffer = length, seed, end, buffer
        self.pool, self.tokenizer, self.files = pool, tokenizer, tuple(files)
        self.consumed = 0
        self._chunks = self._endless()

    def _epoch_documents(self, epoch: int) -> Iterator[list[int]]:
        if self.pool is not None:
            order = list(range(len(self.pool)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            return (self.pool[i] for i in order)
        return file_documents(self.tokenizer, self.files)

    def _endless(self) -> Iterator[list[int]]:
        rng = random.Random(f"{self.seed}:buffer")
        # The pool is shuffled by document each epoch; files need the buffer.
        size = 1 if self.pool is not None else self.buffer
        buffer: list[list[int]] = []
        epoch = 0
        while True:
            produced = False
            for chunk in pack(self._epoch_documents(epoch), self.length, self.end):
                produced = True
                buffer.append(chunk)
                if len(buffer) >= size:
                    yield buffer.pop(rng.randrange(len(buffer)))
            if not produced:
                raise MtpkitError(
                    f"the training text holds fewer than {self.length} tokens: "
                    "give more text or a smaller --seq-len"
                )
            epoch += 1

    def next_batch(self, batch_size: int) -> mx.array:
        rows = [next(self._chunks) for _ in range(batch_size)]
        self.consumed += batch_size
        return mx.array(rows, dtype=mx.int32)

    def skip(self, chunks: int) -> None:
        """Consume `chunks` chunks (a resumed run catching up with its checkpoint)."""
        for _ in range(chunks):
            next(self._chunks)
        self.consumed += chunks
