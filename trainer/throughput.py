"""The training clock of a run: the time its throughput (tokens/s, MFU) is measured over.

Time is read only at *synchronized boundaries*: the start of `fit` and the end of each logged step, each
after the device has finished the work queued so far. On CUDA, kernels run asynchronously, so a clock read
on the host without that wait measures how fast steps are queued, not run; the wait would then happen
later, at whatever synchronizes next (the logged loss's `.item()`), outside the step that caused it, and
the logged tokens/s would depend on `log_every`. Unlogged steps are not synchronized (it would slow them).

Between two boundaries the interval is wall-clock, so nothing a training step needs is left out (loading
data, the callbacks, logging) and every second lands in exactly one interval; only what is not training
is taken out: validation and checkpoint saves and loads, which run inside `paused()`.

The first steps of a run are slower than the rest (torch.compile's compilation, the allocator growing to
its working set, lazy initialization), so the run's *steady* figure leaves out a warm-up: the first
`warmup_steps` steps of this fit and the rest of the logged interval they end in (time can only be cut at
a boundary). The steady window runs from the first boundary with at least `warmup_steps` steps before it
to the end of the run; `warmup_steps=0` makes it the whole run.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass
class Interval:
    """The work done between two synchronized boundaries and the training time it took."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: "Interval") -> None:
        self.steps += other.steps
        self.tokens += other.tokens
        self.seconds += other.seconds


class ThroughputMeter:
    """Training time and work of one `fit`, measured between synchronized boundaries.

    `synchronize` waits for the device (`Strategy.synchronize`); `now` is the clock (`time.perf_counter`;
    tests give a fake one). The loop calls `start` when fit begins, `add_step` after each step, `close` at
    each logged step (and at the end of a run stopped on an unlogged step), and runs validation and
    checkpoints inside `paused()`. Tokens and steps count the work processed: steps a rollback (the
    loss-spike stabilizer) replays are counted each time they run, as their time is.
    """

    def __init__(self, warmup_steps: int, synchronize: Callable[[], None],
                 now: Callable[[], float] = time.perf_counter) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.synchronize = synchronize
        self.now = now
        self.total = Interval()  # every closed interval: the whole training, warm-up included
        self.steady = Interval()  # the closed intervals after the warm-up
        # Step numbers (the trainer's) of the steady window: it covers the steps after `steady_after`.
        self.steady_after: int | None = None
        self.first_step = 0  # the trainer's step when fit started
        self.last_step = 0  # the trainer's step at the last boundary
        self._open = Interval()  # steps and tokens since the last boundary (seconds: unused)
        self._mark = 0.0  # the clock at the last boundary
        self._paused_s = 0.0  # seconds paused since the last boundary
        self._pause_depth = 0  # paused() nests (a save inside validation): only the outermost counts

    @property
    def open_steps(self) -> int:
        """Steps taken since the last boundary (not yet in any interval)."""
        return self._open.steps

    def start(self, step: int) -> None:
        """The first boundary, at trainer step `step`: what was queued before fit (a resumed load, the
        model's initialization) finishes before the clock starts."""
        self.synchronize()
        self.total, self.steady, self._open = Interval(), Interval(), Interval()
        self.first_step = self.last_step = step
        self.steady_after = step if self.warmup_steps == 0 else None
        self._paused_s = 0.0
        self._mark = self.now()

    def add_step(self, tokens: int) -> None:
        """One training step of `tokens` tokens (over all ranks) has been queued."""
        self._open.steps += 1
        self._open.tokens += tokens

    def close(self, step: int) -> Interval:
        """A boundary at trainer step `step`: wait for the device, then end the open interval there and
        return it (its seconds exclude the time paused in it)."""
        self.synchronize()  # before reading the clock: the interval's device work is inside it
        now = self.now()
        interval = Interval(self._open.steps, self._open.tokens, now - self._mark - self._paused_s)
        self.total.add(interval)
        if self.steady_after is not None:
            self.steady.add(interval)
        elif self.total.steps >= self.warmup_steps:
            self.steady_after = step  # the warm-up ends here: the steady window starts at this boundary
        self.last_step = step
        self._open = Interval()
        self._paused_s = 0.0
        self._mark = now
        return interval

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time of the block out of the open interval (validation, checkpoints). The device
        finishes the training work queued before the block first, so that wait stays training time."""
        self._pause_depth += 1
        outermost = self._pause_depth == 1
        if outermost:
            self.synchronize()
            began = self.now()
        try:
            yield
        finally:
            self._pause_depth -= 1
            if outermost:
                self._paused_s += self.now() - began
