"""train-head's progress on stderr, where it shows a run is alive and how it goes.

On a terminal: a step bar (loss and held-out acceptance in its postfix), created at the first
optimizer step so that its rate and ETA leave out the data generation before it. Elsewhere
(a CI log, a file, a pipe), where a bar would print nothing until the end: one line per
held-out measurement (at the start, every --eval-every steps and at the end) and one per
checkpoint interval, each with the elapsed time and an ETA from the steps done so far.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mtpkit.core.console import progress_disabled, step_bar


class TrainProgress:
    def __init__(self, steps: int, *, quiet: bool, log: Callable[[str], None]) -> None:
        self.steps, self.quiet, self.log = steps, quiet, log
        self.lines = not quiet and progress_disabled(quiet)
        self.bar: Any = None
        self.started: float | None = None
        self.first_step = 0
        self.status: dict[str, str] = {}

    def __call__(self, step: int, loss: float | None, heldout: float | None) -> None:
        """Called at step 0 (the held-out acceptance before training, loss None) and after
        every optimizer step."""
        if heldout is not None:
            self.status["held-out"] = f"{100 * heldout:.1f}%"
        if loss is None:
            if self.lines and heldout is not None:
                self.log(f"step {step}/{self.steps}: held-out acceptance {100 * heldout:.1f}%")
            return
        if self.started is None:  # the first optimizer step: data generation is behind us
            self.started, self.first_step = time.perf_counter(), step - 1
            if not self.quiet and not self.lines:
                self.bar = step_bar(self.steps, initial=step - 1, desc="train-head")
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(loss=f"{loss:.4f}", **self.status, refresh=True)
        elif self.lines and (heldout is not None or step == self.steps):
            self.log(self._line(step, loss, heldout))

    def _line(self, step: int, loss: float, heldout: float | None) -> str:
        assert self.started is not None
        elapsed = time.perf_counter() - self.started
        done = step - self.first_step
        left = elapsed / done * (self.steps - step) if done else 0.0
        acc = f", held-out acceptance {100 * heldout:.1f}%" if heldout is not None else ""
        return (
            f"step {step}/{self.steps}: loss {loss:.4f}{acc} "
            f"({elapsed:.0f}s elapsed, about {left:.0f}s left)"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
