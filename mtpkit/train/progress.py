"""train-head's progress on stderr, where it shows a run is alive and how it goes.

Two phases, each shown: generating the training text (a minute or more on a CPU, before the
first step) and the optimizer steps. On a terminal: a bar for each (the step bar has loss
and held-out acceptance in its postfix and is created at the first optimizer step, so that
its rate and ETA leave out the data generation before it). Elsewhere (a CI log, a file, a
pipe, or bars turned off by HF_HUB_DISABLE_PROGRESS_BARS), where a bar would print nothing
until the end: lines, each with the elapsed time and an ETA; for the text, one at each
quarter of it; for the steps, one per held-out measurement (at the start, every
--eval-every steps and at the end). `--quiet` shows neither; `--json` does not change
stderr.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mtpkit.core.console import progress_disabled, step_bar

# Lines a log gets while the text is generated: one at each quarter.
DATA_LINES = 4


class TrainProgress:
    def __init__(self, steps: int, *, quiet: bool, log: Callable[[str], None]) -> None:
        self.steps, self.quiet, self.log = steps, quiet, log
        self.lines = not quiet and progress_disabled(quiet)
        self.bar: Any = None
        self.started: float | None = None
        self.first_step = 0
        self.status: dict[str, str] = {}
        self.data_bar: Any = None
        self.data_started: float | None = None
        self.data_lines_done = 0

    def data(self, done: int, total: int) -> None:
        """Called as the training text is generated: `done` of `total` samples."""
        if self.quiet or total <= 0:
            return
        if self.data_started is None:
            self.data_started = time.perf_counter()
            if not self.lines:
                self.data_bar = step_bar(total, desc="generating text", unit="sample")
        if self.data_bar is not None:
            self.data_bar.n = done
            self.data_bar.refresh()
            if done >= total:
                self.data_bar.close()
                self.data_bar = None
            return
        quarter = DATA_LINES * done // total
        if self.lines and quarter > self.data_lines_done:
            self.data_lines_done = quarter
            elapsed = time.perf_counter() - self.data_started
            left = elapsed / done * (total - done) if done else 0.0
            self.log(
                f"generating text to train on: {done}/{total} samples "
                f"({elapsed:.0f}s elapsed, about {left:.0f}s left)"
            )

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
        if self.data_bar is not None:
            self.data_bar.close()
        if self.bar is not None:
            self.bar.close()
