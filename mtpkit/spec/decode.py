"""Lossless speculative decoding with a checkpoint's own MTP head: the draft/verify/accept round.

Each round the head drafts K tokens (chaining itself K times), the backbone verifies
`[last confirmed token, draft_1..draft_K]` in one forward pass, and the longest prefix the
backbone agrees with is kept, plus the backbone's own next token. Greedy decoding keeps a
draft iff it equals the backbone's argmax, so the output is the backbone's greedy output;
at a temperature, exact rejection sampling keeps the output distribution the backbone's.
After a partial acceptance the caches roll back to the kept prefix (`runtime.VerifyPass`).
When drafting loses to plain decoding, `AdaptiveDrafting` pauses it.

The host waits on the device once per round: the acceptance is decided on the device
(`mtpkit.spec.accept`) and read back as one small array, and before that read the head's step
over the verified pairs (the next round drafts from the last confirmed one) is queued with
`mx.async_eval`, as mlx-lm's `generate_step` queues the next token's forward. The pairs past
the accepted prefix are trimmed from the head's cache after the read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mtpkit.runtime.model import POST_NORM, MtpModel, NoMtpHead
from mtpkit.runtime.rollback.verify_pass import VerifyPass
from mtpkit.spec.accept import SamplingSettings, read_verdict, rejection_sample, verdict

# SamplingSettings and rejection_sample live in mtpkit.spec.accept; importable from here too.
__all__ = ["AdaptiveDrafting", "MtpDecoder", "SamplingSettings", "Stats", "rejection_sample"]

MAX_DEPTH = 4
HEAD_CHUNK = 2048  # pairs per head forward when it catches up with confirmed tokens
CATCH_UP_AFTER = 256  # plain steps after which the head catches up while drafting is off


# ---------------------------------------------------------------------------------------
# Statistics and adaptive drafting.


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    drafted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted_by_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    # As mlx-lm reports them: the prompt's time runs to the first output (for MTP, the first
    # round), the decode rate counts the tokens after it.
    prompt_time: float = 0.0
    decode_time: float = 0.0
    decode_tokens: int = 0
    rounds: int = 0
    last_accepted: int = 0
    plain_steps: int = 0
    # (position in prompt + output of the first draft, the drafts) for every round.
    draft_log: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def acceptance_by_depth(self, depth: int) -> list[float | None]:
        return [
            (self.accepted_by_depth[i] / self.drafted_by_depth[i])
            if self.drafted_by_depth[i]
            else None
            for i in range(depth)
        ]

    def record_round(self, position: int, drafts: list[int], accepted: int) -> None:
        self.draft_log.append((position, drafts))
        self.last_accepted = accepted
        self._count(drafts, accepted, +1)
        self.rounds += 1

    def end_round_at(self, kept: int) -> None:
        """The last round's output ended after `kept` of its tokens (at an EOS): drafts from
        there on, the EOS among them, count as neither drafted nor accepted."""
        position, drafts = self.draft_log[-1]
        if kept >= self.last_accepted:
            return  # the EOS was the round's own next token, not a draft
        self._count(drafts, self.last_accepted, -1)
        self.draft_log[-1] = (position, drafts[:kept])
        self.last_accepted = kept
        self._count(drafts[:kept], kept, +1)

    def _count(self, drafts: list[int], accepted: int, sign: int) -> None:
        self.drafted += sign * len(drafts)
        self.accepted += sign * accepted
        for j in range(min(accepted + 1, len(drafts))):
            self.drafted_by_depth[j] += sign
            self.accepted_by_depth[j] += sign if j < accepted else 0


class AdaptiveDrafting:
    """Switches drafting off while it loses to plain decoding, and retries later.

    After two drafting rounds, four plain steps are timed for a reference. Then two checks
    on drafting rounds:
    - hopeless: the faster of the last two rounds took longer than the plain steps for all
      the tokens a round can yield (depth + 1), so no acceptance rate could pay for it
      (a verify pass that costs as much as the tokens in it, as on CPUs): off for 256
      tokens, doubling to 4096;
    - barren: the head has not had one draft accepted in its first 4 rounds, and rounds
      cost more than a plain step: treated as hopeless;
    - losing: over the last 6 rounds, or clearly (by a quarter) over the last 2, seconds
      per emitted token exceed plain decoding's: off for 32 tokens, doubling to 1024,
      reset after a long winning run.
    Each retry costs at most a few rounds, a few percent of the plain time at worst.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.window = 6
        self.plain_stretch = 32
        self.hopeless_stretch = 256
        self.mtp_times: list[tuple[float, int]] = []
        self.plain_times: list[float] = []
        self.plain_left = 0
        self.capacity = 2  # tokens a round can yield: depth + 1
        self.rounds = 0  # drafting rounds so far, and those that kept a draft
        self.fruitful = 0
        # Plain speed is measured after the first two rounds (so that short generations
        # draft from the start), over four steps.
        self.probing_plain = False

    def want_draft(self) -> bool:
        if not self.enabled:
            return True
        return self.plain_left <= 0 and not self.probing_plain

    def plain_ahead(self) -> int:
        """Plain steps certain to follow the current one (read before recording it)."""
        if not self.enabled:
            return 0
        if self.probing_plain:
            return max(0, 4 - len(self.plain_times) - 1)
        return max(0, self.plain_left - 1)

    def record_plain(self, seconds: float) -> None:
        if not self.enabled:
            return
        self.plain_times = (self.plain_times + [seconds])[-32:]
        self.plain_left -= 1
        if self.probing_plain and len(self.plain_times) >= 4:
            self.probing_plain = False
            self.plain_left = 0
            self._judge()  # the rounds before the probe may already be hopeless

    def _plain_per_token(self) -> float:
        # The first plain step after a drafting stretch carries the head's catch-up.
        plain = sorted(self.plain_times[1:] or self.plain_times)
        return plain[len(plain) // 2]

    def record_round(self, seconds: float, emitted: int, capacity: int) -> None:
        """A drafting round took `seconds` and yielded `emitted` of at most `capacity`."""
        if not self.enabled:
            return
        self.mtp_times.append((seconds, emitted))
        self.capacity = capacity
        self.rounds += 1
        self.fruitful += emitted > 1
        if not self.plain_times:
            if len(self.mtp_times) >= 2:
                self.probing_plain = True
            return
        self._judge()

    def _judge(self) -> None:
        capacity = self.capacity
        plain_per_token = self._plain_per_token()
        if len(self.mtp_times) >= 2:
            fastest = min(s for s, _ in self.mtp_times[-2:])
            barren = self.rounds >= 4 and not self.fruitful and fastest > plain_per_token
            if fastest > capacity * plain_per_token or barren:
                self.plain_left = self.hopeless_stretch
                self.hopeless_stretch = min(self.hopeless_stretch * 2, 4096)
                self.mtp_times = []
                return
            best_per_token = min(s / n for s, n in self.mtp_times[-2:])
            if best_per_token > 1.25 * plain_per_token:
                self._pause()
                return
        if len(self.mtp_times) < self.window:
            return
        recent = self.mtp_times[-self.window :]
        mtp_per_token = sum(s for s, _ in recent) / sum(n for _, n in recent)
        if mtp_per_token > plain_per_token:
            self._pause()
        elif len(self.mtp_times) >= 4 * self.window:
            self.plain_stretch = 32
            self.mtp_times = self.mtp_times[-self.window :]

    def _pause(self) -> None:
        self.plain_left = self.plain_stretch
        self.plain_stretch = min(self.plain_stretch * 2, 1024)
        self.mtp_times = []


# ---------------------------------------------------------------------------------------
# The head's side: its KV cache and the confirmed pairs it has not seen yet.


class HeadDrafter:
    """Drafts with the MTP head. Confirmed pairs (h_k, t_{k+1}) reach the head's cache in two
    ways: after a drafting round, by `queue` (all of the round's pairs in one step, before its
    acceptance is read) and `settle` (the unconfirmed ones trimmed), leaving `ready`, the
    head's output at the last confirmed pair; after plain steps, they wait in `pending`
    until the next draft or a catch-up runs the head over them."""

    def __init__(self, m: MtpModel) -> None:
        self.m = m
        self.head = m.head
        self.cache = m.head.make_cache()
        self.pending_hidden: list[mx.array] = []
        self.pending_tokens: list[int] = []
        self.ready: mx.array | None = None
        self._queued: mx.array | None = None

    def add(self, hidden: mx.array, tokens: list[int]) -> None:
        self.pending_hidden.append(hidden)
        self.pending_tokens.extend(tokens)

    def _pending(self) -> tuple[mx.array, list[int]]:
        return mx.concatenate(self.pending_hidden, axis=1), self.pending_tokens

    def catch_up(self, keep_last: bool = True) -> None:
        """Run the head over the pending pairs (keeping the last one to draft from)."""
        hidden, tokens = self._pending()
        n = len(tokens) - (1 if keep_last else 0)
        for i in range(0, n, HEAD_CHUNK):
            j = min(i + HEAD_CHUNK, n)
            x = self.head(hidden[:, i:j], self.m.embed(mx.array(tokens[i:j])[None]), self.cache)
            mx.eval(x, [c.state for c in self.cache])
        self.pending_hidden = [hidden[:, n:]]
        self.pending_tokens = tokens[n:]

    def can_draft(self) -> bool:
        return bool(self.pending_tokens) or self.ready is not None

    def draft(self, depth: int, sampling: SamplingSettings) -> tuple[mx.array, mx.array | None]:
        """`depth` draft tokens (lazy, [K] int32) and, when sampling, their distributions
        [K, V]. Consumes the pending pairs (or `ready`)."""
        head, m = self.head, self.m
        if self.pending_tokens:
            hidden, tokens = self._pending()
            self.pending_hidden, self.pending_tokens = [], []
            x = head(hidden, m.embed(mx.array(tokens)[None]), self.cache, step=0)[:, -1:]
        else:
            x = self.ready
        self.ready = None
        drafts: list[mx.array] = []
        dists = []
        normed = None
        for k in range(depth):
            if k > 0:
                prev = normed if m.hidden == POST_NORM else x
                x = head(prev, m.embed(drafts[-1].reshape(1, 1)), self.cache, step=k)
            normed = head.final_norm(head.layer_for_step(k))(x)
            logits = m.lm_head(normed)[0, -1]
            if sampling.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                q = sampling.probs(logits)
                token = mx.random.categorical(mx.log(q))
                dists.append(q)
            drafts.append(token.astype(mx.int32).reshape(1))
        return mx.concatenate(drafts), (mx.stack(dists) if dists else None)

    def drop_drafts(self, depth: int) -> None:
        """Drop the head-cache entries built on drafts (steps 1..depth-1)."""
        per_layer = [0] * len(self.cache)
        for step in range(1, depth):
            per_layer[self.head.layer_for_step(step)] += 1
        for cache, n in zip(self.cache, per_layer, strict=True):
            if n:
                cache.trim(n)

    def queue(self, depth: int, hidden: mx.array, followers: mx.array) -> None:
        """Start the head's step over every pair of a verify pass (hidden [1, K+1, H], the
        token after each input) before the host knows how many are confirmed (one call,
        queued with `mx.async_eval`); `settle` trims the pairs past the confirmed ones."""
        self.drop_drafts(depth)
        out = self.head(hidden, self.m.embed(followers[None]), self.cache, step=0)
        mx.async_eval(out)
        self._queued = out

    def settle(self, kept: int) -> None:
        """Keep the queued step's first `kept` pairs; the next draft starts from the last."""
        out, self._queued = self._queued, None
        rejected = out.shape[1] - kept
        if rejected:  # step 0's entries, at the end of its layer's cache
            self.cache[self.head.layer_for_step(0)].trim(rejected)
        self.ready = out[:, kept - 1 : kept]


# ---------------------------------------------------------------------------------------
# One generation.


class MtpDecoder:
    """One generation: prefill, then drafting rounds (draft, verify, accept, roll back) and
    plain steps until done."""

    def __init__(
        self,
        m: MtpModel,
        prompt: list[int],
        *,
        depth: int,
        sampling: SamplingSettings,
        adaptive: bool,
        use_mtp: bool = True,
        max_kv_size: int | None = None,
    ) -> None:
        if m.head is None and use_mtp:
            raise NoMtpHead(f"{m.path} has no MTP head")
        self.m, self.prompt, self.depth, self.sampling = m, prompt, depth, sampling
        self.use_mtp = use_mtp
        self.adaptive = AdaptiveDrafting(adaptive and use_mtp)
        self.cache = m.make_cache(max_kv_size)
        self.drafter = HeadDrafter(m) if m.head is not None else None
        # The last confirmed token: the backbone has not consumed it yet.
        self.last_token = prompt[-1]
        self._ahead: tuple[mx.array, mx.array] | None = None
        self.n_confirmed = 0  # tokens confirmed after the prompt
        self.stats = Stats(prompt_tokens=len(prompt))
        self.sampler = sampling.sampler()

    def prefill(self, step_size: int = 2048) -> None:
        """All but the last prompt token, in chunks, as mlx-lm's `generate_step` does; the
        last one is the first input of the decoding loop."""
        from mlx_lm.generate import generation_stream

        start = time.perf_counter()
        prompt = self.prompt
        with mx.stream(generation_stream):
            for i in range(0, len(prompt) - 1, step_size):
                chunk = prompt[i : min(i + step_size, len(prompt) - 1)]
                _, hidden = self.m.forward(mx.array(chunk)[None], self.cache)
                mx.eval([c.state for c in self.cache], hidden)
                if self.drafter is not None:
                    self.drafter.add(hidden, prompt[i + 1 : i + 1 + len(chunk)])
                mx.clear_cache()
            if self.drafter is not None and len(self.drafter.pending_tokens) > 1:
                self.drafter.catch_up()  # the head's KV cache over the prompt
        self.stats.prompt_time = time.perf_counter() - start

    # -- the round: draft, verify, judge, read once, roll back ---------------------------
    def verify(self, drafts: mx.array) -> VerifyPass:
        tokens = mx.concatenate([mx.array([self.last_token], dtype=mx.int32), drafts])
        return self.m.verify(tokens, self.cache)

    def settle(self, verified: VerifyPass, kept: int) -> None:
        """Undo the effect of the rejected verify inputs on the backbone's caches, and give
        the head the confirmed pairs."""
        self.drafter.settle(kept)
        verified.rollback(self.cache, kept)

    def draft_round(self) -> list[int]:
        """One drafting round; returns the tokens it confirms (at least one)."""
        drafts_arr, dists = self.drafter.draft(self.depth, self.sampling)
        verified = self.verify(drafts_arr)
        packed, followers = verdict(verified.logits[0], drafts_arr, dists, self.sampling)
        mx.async_eval(packed)
        # The next round's head step, queued before the read so that the device runs it
        # while the host settles this round.
        self.drafter.queue(self.depth, verified.hidden, followers)
        accepted, next_token, drafts = read_verdict(packed, self.sampling.greedy)  # one host read
        kept = accepted + 1  # verify inputs whose effect on the caches stays
        self.settle(verified, kept)
        confirmed = drafts[:accepted] + [next_token]
        self.stats.record_round(len(self.prompt) + self.n_confirmed, drafts, accepted)
        self.n_confirmed += len(confirmed)
        self.last_token = next_token
        return confirmed

    # -- plain steps ----------------------------------------------------------------------
    def _plain_forward(self, token: mx.array) -> tuple[mx.array, mx.array]:
        logits, hidden = self.m.forward(token.reshape(1, 1), self.cache)
        logits = logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return self.sampler(logprobs), hidden

    def plain_step(self, ahead: bool = False) -> list[int]:
        """One backbone step, as mlx-lm's generate_step takes it. With `ahead` (the next
        step is certain to be plain too) the next forward is queued before this token is
        read, so the two overlap as in mlx-lm's own loop."""
        if self._ahead is not None:
            y, hidden = self._ahead
            self._ahead = None
        else:
            y, hidden = self._plain_forward(mx.array([self.last_token]))
        if ahead:
            self._ahead = self._plain_forward(y)
            mx.async_eval(*self._ahead)
        token = int(y.item())
        self.last_token = token
        self.n_confirmed += 1
        if self.drafter is not None:
            self.drafter.add(hidden, [token])
            if len(self.drafter.pending_tokens) > CATCH_UP_AFTER:
                self.drafter.catch_up()
        self.stats.plain_steps += 1
        return [token]

    # -- the loop -------------------------------------------------------------------------
    def step(self, may_look_ahead: bool) -> list[int]:
        """A drafting round or a plain step, as adaptive drafting decides; timed for it."""
        t0 = time.perf_counter()
        can_draft = self.use_mtp and self.drafter is not None
        drafting = can_draft and self.adaptive.want_draft() and self._ahead is None
        if drafting and self.drafter.can_draft():
            new = self.draft_round()
            self.adaptive.record_round(time.perf_counter() - t0, len(new), self.depth + 1)
            return new
        ahead = not can_draft or self.adaptive.plain_ahead() > 0
        new = self.plain_step(ahead=ahead and may_look_ahead)
        self.adaptive.record_plain(time.perf_counter() - t0)
        return new

    def tokens(self, max_tokens: int) -> Iterator[int]:
        from mlx_lm.generate import generation_stream, wired_limit

        eos = set(getattr(self.m.tokenizer, "eos_token_ids", None) or [])
        start = time.perf_counter()
        produced, first_done, first_count = 0, None, 0
        with wired_limit(self.m.model, [generation_stream]):
            self.prefill()
            try:
                with mx.stream(generation_stream):
                    while produced < max_tokens:
                        rounds = self.stats.rounds
                        new = self.step(may_look_ahead=produced + 1 < max_tokens)
                        if first_done is None:
                            first_done, first_count = time.perf_counter(), len(new)
                            self.stats.prompt_time = first_done - start
                        for i, t in enumerate(new):
                            if t in eos:
                                if self.stats.rounds > rounds:
                                    self.stats.end_round_at(i)
                                return
                            self.stats.generated.append(t)
                            produced += 1
                            yield t
                            if produced >= max_tokens:
                                break
            finally:
                if first_done is not None:
                    self.stats.decode_time = time.perf_counter() - first_done
                    self.stats.decode_tokens = max(0, len(self.stats.generated) - first_count)
