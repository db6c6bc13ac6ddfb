"""The LR-schedule interface: a pure function of the optimizer step returning a multiplier of the base LR
(handed to `torch.optim.lr_scheduler.LambdaLR`), with the warmup every schedule shares. Schedules are in
trainer/plugins/lr_schedules; `step` counts optimizer updates already taken.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


def check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ValueError unless ``value`` is an int in ``[low, high]``."""
    allowed = f"[{low}, inf)" if high is None else f"[{low}, {high}]"
    # bool is an int subclass; `warmup_steps: true` is a config typo, not 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer in {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in {allowed}, got {value}")


def check_float(
    name: str, value: object, low: float, high: float, low_inclusive: bool = True
) -> None:
    """Raise ValueError unless ``value`` is a real number in the given interval."""
    allowed = f"{'[' if low_inclusive else '('}{low}, {high}{']' if math.isfinite(high) else ')'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in {allowed}, got {value!r}")
    too_low = value < low if low_inclusive else value <= low
    # NaN and inf would silently poison every LR downstream.
    if not math.isfinite(value) or too_low or value > high:
        raise ValueError(f"{name} must be in {allowed}, got {value}")


# Not slotted on purpose: LambdaLR.state_dict() checkpoints callable objects
# through their ``__dict__`` and restores them with ``__dict__.update``.
@dataclass(frozen=True)
class LRSchedule:
    """Base class: linear warmup followed by a subclass-defined phase.

    Args:
        total_steps: Number of optimizer updates in the run (set by the trainer).
        warmup_steps: Number of linear-warmup updates; 0 disables warmup.
    """

    total_steps: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_int("total_steps", self.total_steps, 1)
        # A warmup longer than the run is allowed (a short smoke run with a production schedule): the LR
        # then ramps for the whole run and never reaches its peak; `warmup_note` says so.
        check_int("warmup_steps", self.warmup_steps, 0)
        self._validate()

    def __call__(self, step: int) -> float:
        """LR multiplier for the update that follows ``step`` updates."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        return self._after_warmup(step)

    @property
    def peak_step(self) -> int:
        """Last warmup step (step 0 without warmup): the first step at multiplier 1."""
        return max(self.warmup_steps - 1, 0)

    def warmup_note(self) -> str | None:
        """One line when the warmup does not fit in the run (the LR never reaches its peak), else None."""
        longest = self._max_warmup_steps()
        if self.warmup_steps <= longest:
            return None
        reached = min(self.total_steps, self.warmup_steps) / self.warmup_steps
        return (f"lr_schedule.warmup_steps={self.warmup_steps} is longer than this schedule allows for a run of "
                f"{self.total_steps} steps (at most {longest}): the LR warms up for the whole run and reaches "
                f"{100 * reached:.0f}% of its peak")

    def _max_warmup_steps(self) -> int:
        """Largest accepted ``warmup_steps``; decaying schedules need room to decay."""
        return self.total_steps

    def _validate(self) -> None:
        """Hook for subclass-specific argument checks."""

    def _after_warmup(self, step: int) -> float:
        raise NotImplementedError
