"""`mtpkit convert --draft-vocab N`: the token ids the MTP head may draft, a subset of the
vocabulary (FR-Spec, arXiv 2502.14856; MTPLX's and exllamav3's 64k heads, mlx-vlm's compact
head), written beside the head as `mtp/draft_vocab.safetensors`.

The head's lm_head is the widest matrix of a draft step (Qwen3.5: 248k rows); drafting over
the N most frequent tokens costs N/V of it. The target still verifies over the whole
vocabulary, so greedy output is unchanged; a sampled draft is drawn from the subset's
distribution and the decoder is handed that distribution spread over the whole vocabulary
(zero outside the subset), so rejection sampling stays exact (`mtpkit.runtime.draft_vocab`).

The N ids: the most frequent tokens of the corpus files given (`--draft-vocab-corpus`), ties
and the rest filled in id order; without a corpus, id order alone, which for byte-level BPE
tokenizers (Qwen, Llama 3, GPT) is merge order, the tokenizer's own frequency ranking. The
tokenizer's special tokens are always kept. The file records the tokenizer's vocabulary hash,
so a subset made for one tokenizer is refused with another.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtpkit.core.errors import MtpkitError

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # beside the head, under mtp/
DRAFT_VOCAB_FORMAT = "mtpkit-draft-vocab"
ID_ORDER = "id_order"  # how the ids were chosen: the tokenizer's own order
CORPUS = "corpus"  # token frequencies of the user's files


def tokenizer_sha256(tokenizer: Any) -> str:
    """A hash of the tokenizer's vocabulary (each token string with its id), the identity a
    draft vocabulary is made for."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else tokenizer.vocab
    pairs = sorted((int(i), str(t)) for t, i in vocab.items())
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=True).encode()).hexdigest()


def special_ids(tokenizer: Any, vocab: int) -> set[int]:
    """Ids a draft may need whatever the corpus: the tokenizer's special and EOS tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids |= set(getattr(tokenizer, "eos_token_ids", None) or [])
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    return {i for i in ids if 0 <= i < vocab}


def corpus_counts(tokenizer: Any, files: Sequence[str]) -> Counter[int]:
    """How often each token id occurs in the files' documents."""
    from mtpkit.core.corpus import file_documents

    counts: Counter[int] = Counter()
    for document in file_documents(tokenizer, files):
        counts.update(document)
    return counts


def choose_ids(size: int, vocab: int, counts: Counter[int], keep: set[int]) -> list[int]:
    """`size` ids: `keep`, then the most frequent of `counts`, then the lowest ids; sorted."""
    chosen = set(sorted(keep)[:size])
    ranked = sorted((i for i in counts if 0 <= i < vocab), key=lambda i: (-counts[i], i))
    for i in ranked:
        if len(chosen) >= size:
            break
        chosen.add(i)
    i = 0
    while len(chosen) < size:
        chosen.add(i)
        i += 1
    return sorted(chosen)


def check_size(size: int, vocab: int) -> None:
    if not 1 <= size < vocab:
        raise MtpkitError(
            f"--draft-vocab {size} must be between 1 and the vocabulary size less one "
            f"({vocab - 1}): the head drafts over a subset of the {vocab} tokens"
        )


def write_draft_vocab(
    model_dir: Path, size: int, corpus: Sequence[str], vocab: int
) -> dict[str, Any]:
    """Choose the ids for the model in `model_dir` (its tokenizer) and write them to
    `mtp/draft_vocab.safetensors`; returns the manifest's `draft_vocab` record."""
    import mlx.core as mx

    from mtpkit.checkpoint.tokenizer import load_tokenizer

    check_size(size, vocab)
    tokenizer = load_tokenizer(model_dir)
    counts = corpus_counts(tokenizer, corpus) if corpus else Counter()
    if corpus and not counts:
        raise MtpkitError(f"--draft-vocab-corpus {', '.join(corpus)} holds no text to count")
    ids = choose_ids(size, vocab, counts, special_ids(tokenizer, vocab))
    record = {
        "path": DRAFT_VOCAB_FILE,
        "size": len(ids),
        "vocab_size": vocab,
        "source": CORPUS if corpus else ID_ORDER,
        "corpus_tokens": sum(counts.values()),
        "corpus_coverage": (
            round(sum(counts[i] for i in ids) / sum(counts.values()), 4) if counts else None
        ),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
    }
    metadata = {"format": DRAFT_VOCAB_FORMAT, **{k: str(v) for k, v in record.items()}}
    target = model_dir / "mtp" / DRAFT_VOCAB_FILE
    target.parent.mkdir(exist_ok=True)
    mx.save_safetensors(str(target), {"ids": mx.array(ids, dtype=mx.int32)}, metadata=metadata)
    return record
