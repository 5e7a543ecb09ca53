"""Ranks in lockstep: rank 0 decides, every rank follows.

Under `mlx.launch` each rank runs the same decoding loop over its part of the backbone. Every
token any rank feeds the backbone is rank 0's choice (drafts, the verdict, plain steps' tokens),
shared lazily by an `all_sum` in which the other ranks add zeros. So every rank's caches (KV,
gated-delta-net states, sliding windows, replayed caches) roll back to the same position every
round, and a sampled text takes one random draw, rank 0's, even where floating-point sums differ
between machines. On one process `Lockstep.share` is the identity.

Collectives must be issued in the same order on every rank: `share` queues its result at once
(`mx.async_eval`), and a rank's placeholder depends on that rank's own copy of the computation
the shared value comes from, so MLX never reorders a share past the backbone's own
send/recv/all_gather.

Before anything else, the ranks `agree` on what they were given (the command's settings, the
model's config and manifest), in their first exchange: a rank given something else would
decode a hybrid, wait in a collective the others never enter, or crash; instead every rank
stops and rank 0 names the difference. After decoding they `meet`, so that no rank exits
while another still needs it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mtpkit.core.errors import MtpkitError


@dataclass(frozen=True)
class Lockstep:
    """The ranks of one decoding; `group` None is a single process."""

    group: Any = None  # mx.distributed.Group
    # Whether rank 0 alone runs the MTP head (pipeline parallelism: the last stage holds it);
    # under tensor parallelism every rank runs it, because the lm_head is sharded.
    head_on_root_only: bool = False
    sharding: str | None = None  # "pipeline" or "tensor" (`mtpkit.runtime.sharded`)

    @property
    def rank(self) -> int:
        return self.group.rank() if self.group is not None else 0

    @property
    def size(self) -> int:
        return self.group.size() if self.group is not None else 1

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def share(self, value: mx.array, after: Sequence[mx.array] = ()) -> mx.array:
        """Rank 0's `value` on every rank, lazily. On the other ranks `value` is only a
        placeholder of the right shape; `after` names what it must be computed after (by
        default `value` itself)."""
        if self.size == 1:
            return value
        mine = value
        if not self.is_root:
            mine = mx.depends(mx.zeros_like(value), list(after) or [value])
        shared = mx.distributed.all_sum(mine, group=self.group)
        mx.async_eval(shared)
        return shared

    def share_int(self, value: int) -> int:
        """Rank 0's integer on every rank, now."""
        if self.size == 1:
            return value
        # Read at once, after every queued share (`drain_streams`); not ordered with
        # `mx.depends`, whose placeholder was seen to carry garbage into this sum.
        drain_streams()
        mine = mx.array(value if self.is_root else 0, dtype=mx.int32)
        return int(mx.distributed.all_sum(mine, group=self.group).item())

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank, now."""
        if self.size == 1:
            return flag
        drain_streams()  # queued shares first: the ring pairs collectives in their order
        doubts = mx.distributed.all_sum(mx.array(int(not flag)), group=self.group)
        return doubts.item() == 0

    def share_choice(self, choice: bool | str | None) -> bool | str | None:
        """Rank 0's True/False/None/"build" on every rank, now."""
        codes = {False: 0, True: 1, None: 2, "build": 3}
        shared = self.share_int(codes[choice])
        return {v: k for k, v in codes.items()}[shared]

    def tick(self) -> None:
        """A decoding step or prefill chunk is done: the watchdog's beat."""
        if self.size > 1 and WATCHDOG[0] is not None:
            WATCHDOG[0].beat()


SINGLE = Lockstep()


def drain_streams() -> None:
    """Wait for everything queued on the default stream and on mlx-lm's generation stream.
    The ring backend pairs collectives in the order each rank runs them; an immediate
    all_sum on the default stream while a `share` of the last decode is still queued on the
    generation stream paired with it on one rank (a garbage sum under `mlx.launch`, ~1 run
    in 6 of the bench test)."""
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)
    mx.synchronize()


class Watchdog:
    """Ends the process with one line when no progress is made for `timeout` seconds: a rank
    that stopped, never started or was given another command, or a network that broke, leaves
    the others waiting inside a collective (or in the ring's set-up), which MLX's backends
    wait on without a limit. Armed from the rank's start; time spent in the rank's own work
    (`local_work`: downloading and reading its weights) is not counted. Runs in a thread (MLX
    releases the GIL while it waits)."""

    def __init__(self, timeout: float, on_timeout: Callable[[float], None]) -> None:
        self.timeout = timeout
        self.on_timeout = on_timeout
        self.last = time.monotonic()
        self.busy = 0  # nesting depth of `local_work`
        self.armed = False
        self.stopped = False

    def beat(self) -> None:
        self.last = time.monotonic()

    def arm(self) -> None:
        """Beat, and start watching if not yet started."""
        import threading

        self.beat()
        if not self.armed:
            self.armed = True
            threading.Thread(target=self._watch, daemon=True, name="mtpkit-watchdog").start()

    def stop(self) -> None:
        self.stopped = True

    def _watch(self) -> None:
        while not self.stopped:
            if self.busy:
                self.beat()
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                self.on_timeout(idle)
                return
            time.sleep(min(1.0, self.timeout / 4))


# The process's watchdog while it is one rank of several (`mtpkit.cli.ranks` installs it).
WATCHDOG: list[Watchdog | None] = [None]


@contextlib.contextmanager
def local_work() -> Iterator[None]:
    """Within the block the rank works on its own (downloads, reads its weights), however
    long that takes: the watchdog does not count it, only the waits on other ranks."""
    dog = WATCHDOG[0]
    if dog is None:
        yield
        return
    dog.busy += 1
    try:
        yield
    finally:
        dog.busy -= 1
        dog.beat()


class RanksDisagree(MtpkitError):
    """The ranks were given different commands or models. Every rank finds the same
    difference; rank 0 alone says it (`mtpkit.cli.ranks`)."""


def facts_of(document: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`document` flattened to dotted keys, each value as short comparable text: its JSON, or
    a digest where the JSON is long (per-layer quantization, a long prompt)."""
    facts: dict[str, str] = {}
    for key, value in document.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            facts |= facts_of(value, f"{name}.")
            continue
        text = json.dumps(value, sort_keys=True, default=str)
        facts[name] = text if len(text) <= 60 else "#" + hashlib.sha256(text.encode()).hexdigest()
    return facts


def gather(group: Any, document: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `document` (JSON), on every rank: their lengths, then the bytes padded
    to the longest, each in one `all_gather`."""
    data = np.frombuffer(json.dumps(dict(document)).encode(), dtype=np.uint8)
    drain_streams()  # queued shares first: the ring pairs collectives in their order
    sizes = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=group)
    lengths = [int(n) for n in np.array(sizes)]
    padded = np.zeros(max(lengths), dtype=np.uint8)
    padded[: data.size] = data
    everyone = np.array(mx.distributed.all_gather(mx.array(padded), group=group))
    width = max(lengths)
    return [
        json.loads(everyone[r * width : r * width + n].tobytes()) for r, n in enumerate(lengths)
    ]


def agree(group: Any, given: Mapping[str, Mapping[str, str]]) -> None:
    """Compare what each rank was `given` (what -> its facts: "command" -> `command_facts`,
    "model" -> `model_facts`) in one exchange; raise `RanksDisagree` on every rank, naming
    the first fact (in rank 0's order) on which a rank differs from rank 0, unless all
    ranks hold the same."""
    every = gather(group, given)
    for what, root in every[0].items():
        for rank, theirs in enumerate((g.get(what, {}) for g in every[1:]), start=1):
            if (detail := _first_difference(root, theirs)) is not None:
                raise RanksDisagree(
                    f"rank {rank} was given another {what}: {detail}; give every rank the "
                    f"same {what}"
                )


def _first_difference(root: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    for key in [*root, *(k for k in theirs if k not in root)]:
        mine, other = root.get(key, "unset"), theirs.get(key, "unset")
        if mine == other:
            continue
        if mine.startswith("#") or other.startswith("#"):
            return f"{key} differs"
        return f"{key} is {other} there, {mine} on rank 0"
    return None


def meet(group: Any) -> None:
    """Every rank's queued work done, then a barrier: a rank that exited with a step still
    queued (mlx-lm's `generate_step` queues the next one before it yields a token) would
    close its sockets while another rank still needs its part of that step."""
    drain_streams()
    mx.distributed.all_sum(mx.array(1), group=group).item()
