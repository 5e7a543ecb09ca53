"""Each row's own draws in a batched round: its verdict over its own first drafts (greedy,
or exact rejection sampling with its own settings and PRNG key), the token of a plain step,
and its first token as it joins. A row's draws read only its own logits and keys, so they
are the same alone or in any batch."""

from __future__ import annotations

import mlx.core as mx

from mtpkit.speculative.accept import (
    SamplingSettings,
    packed_greedy,
    packed_plain,
    sampled_verdict,
)
from mtpkit.speculative.batch.row import Row
from mtpkit.speculative.proposers import RowsProposal


def round_keys(row: Row, depth: int) -> list[mx.array | None]:
    """A round's keys for `row`: one per draft of the round's `depth`, then its verdict's.
    Split by the row's own depth, so that its draws do not depend on its batchmates'; the
    drafts past its depth, which it never verifies, draw from the global state."""
    if row.sampling.greedy:
        return [None] * (depth + 1)
    keys = row.next_keys(row.depth + 1)
    return keys[: row.depth] + [None] * (depth - row.depth) + keys[-1:]


def row_verdicts(
    logits: mx.array, proposal: RowsProposal, rows: list[Row], keys: list[mx.array | None]
) -> tuple[list[mx.array], mx.array]:
    """Each row's packed verdict over its own first `proposal.depths[r]` drafts (lazy; packed
    and read by `accept`'s functions only) and the confirmed token after each verify input
    [B, K+1] (valid up to the count kept). Greedy rows share one argmax over the batch."""
    drafts, dists = proposal.drafts, proposal.dists
    packs: list[mx.array] = []
    followers: list[mx.array] = []
    width = drafts.shape[1] + 1
    targets = None
    for r, row in enumerate(rows):
        d, s = proposal.depths[r], row.sampling
        if s.greedy:
            if targets is None:
                targets = greedy_targets(logits)
            packs.append(packed_greedy(targets[r, : d + 1], drafts[r, :d]))
            followers.append(targets[r])
            continue
        if d == 0:  # drafting off: the token drawn as a plain step draws it
            token = mx.random.categorical(mx.log(s.probs(logits[r, 0])), key=keys[r])
            packed = packed_plain(token)
            follow = packed[1:]
        else:
            packed, follow = sampled_verdict(
                s.probs(logits[r, : d + 1]), dists[r][:d], drafts[r, :d], keys[r]
            )
        packs.append(packed)
        followers.append(mx.concatenate([follow, mx.repeat(follow[-1:], width - d - 1)]))
    return packs, mx.stack(followers)


def greedy_targets(logits: mx.array) -> mx.array:
    """The backbone's argmax after every verify input of every row [B, K+1] (of its
    log-probabilities, as `accept.greedy_verdict` and mlx-lm's greedy sampler take it)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1).astype(mx.int32)


def draw_rows(logits: mx.array, rows: list[Row]) -> mx.array:
    """Each row's token [B] from its logits [B, V]: the argmax for a greedy row, else a draw
    as `_sample` takes it (by the row's own key when it has a seed). The argmax is over the
    log-probabilities, as mlx-lm's greedy sampler takes it (in bfloat16 subtracting the
    normalizer can make two logits tie); every row greedy, no per-row slices."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    greedy = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if all(row.sampling.greedy for row in rows):
        return greedy
    picks = []
    for r, row in enumerate(rows):
        if row.sampling.greedy:
            picks.append(greedy[r])
            continue
        key = row.next_keys(1)[0]
        if key is None:
            picks.append(row.sampling.sampler()(logprobs[r : r + 1])[0].astype(mx.int32))
        else:
            q = row.sampling.probs(logits[r])
            picks.append(mx.random.categorical(mx.log(q), key=key).astype(mx.int32))
    return mx.stack(picks)


def sample_first(logits: mx.array, sampling: SamplingSettings, key: mx.array | None) -> int:
    """A row's first token from the logits of its last prompt token [1, V], as mlx-lm's
    sampler draws it from the log-probabilities (with a key: from the same distribution,
    `SamplingSettings.probs`, by the row's own key)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if key is None or sampling.greedy:
        return int(sampling.sampler()(logprobs).item())
    return int(mx.random.categorical(mx.log(sampling.probs(logits[0])), key=key).item())
