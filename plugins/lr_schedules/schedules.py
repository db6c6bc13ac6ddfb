"""Learning-rate schedules as pure functions of the optimizer step.

Every schedule returns a *multiplier* of the base learning rate (the base LR
lives in the optimizer config), so a schedule can be handed straight to
:class:`torch.optim.lr_scheduler.LambdaLR`.  ``step`` counts optimizer updates
already taken: ``schedule(0)`` is the multiplier of the first update.

Conventions shared by all schedules:

* Warmup: for ``step < warmup_steps`` the multiplier is
  ``(step + 1) / warmup_steps``, so the first update already uses a non-zero
  LR and the last warmup step reaches exactly 1.
* Peak: ``peak_step = max(warmup_steps - 1, 0)`` is the first step at
  multiplier 1.  Cosine, linear and inverse-sqrt decays start there, so they
  are continuous with the warmup and do not repeat the peak; WSD holds it
  until its cooldown.
* Decay to a floor (cosine, linear, WSD): reaches ``min_ratio`` exactly at
  ``total_steps - 1`` and stays there afterwards (runs that overshoot
  ``total_steps`` keep training at the floor LR).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from trainer.interfaces.lr_schedule import LRSchedule, check_float as _check_float

__all__ = [
    "LRSchedule",
    "Constant",
    "WarmupCosine",
    "WarmupLinear",
    "WSD",
    "DecayShape",
    "InverseSqrt",
]


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Shared maths
# ---------------------------------------------------------------------------


def _progress(step: int, start: int, end: int) -> float:
    """Fraction of the way from ``start`` to ``end``, clamped to ``[0, 1]``.

    ``end`` wins when ``start == end`` so that a one-step decay phase still
    lands on its final value.
    """
    if step >= end:
        return 1.0
    if step <= start:
        return 0.0
    return (step - start) / (end - start)


def _linear_shape(progress: float) -> float:
    return 1.0 - progress


def _cosine_shape(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _sqrt_shape(progress: float) -> float:
    return 1.0 - math.sqrt(progress)


def _interpolate(shape: Callable[[float], float], progress: float, floor: float) -> float:
    """Map a 1 -> 0 decay ``shape`` onto the range 1 -> ``floor``."""
    return floor + (1.0 - floor) * shape(progress)


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Constant(LRSchedule):
    """Linear warmup, then a constant multiplier of 1.

    ``warmup_steps`` may be at most ``total_steps``.
    """

    def _after_warmup(self, step: int) -> float:
        return 1.0


@dataclass(frozen=True)
class _DecayToFloor(LRSchedule):
    """Warmup, then a decay from 1 at ``peak_step`` to ``min_ratio`` at the end."""

    min_ratio: float = 0.0

    def _max_warmup_steps(self) -> int:
        return self.total_steps - 1

    def _validate(self) -> None:
        _check_float("min_ratio", self.min_ratio, 0.0, 1.0)

    def _shape(self, progress: float) -> float:
        raise NotImplementedError

    def _after_warmup(self, step: int) -> float:
        progress = _progress(step, self.peak_step, self.total_steps - 1)
        return _interpolate(self._shape, progress, self.min_ratio)


@dataclass(frozen=True)
class WarmupCosine(_DecayToFloor):
    """Linear warmup, then half-cosine decay to ``min_ratio``.

    For ``step >= warmup_steps``, with ``peak_step = max(warmup_steps - 1, 0)``
    and ``p = min(1, (step - peak_step) / (total_steps - 1 - peak_step))``::

        min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * p))

    ``warmup_steps`` may be at most ``total_steps - 1``.
    """

    min_ratio: float = 0.1

    def _shape(self, progress: float) -> float:
        return _cosine_shape(progress)


@dataclass(frozen=True)
class WarmupLinear(_DecayToFloor):
    """Linear warmup, then linear decay to ``min_ratio``.

    For ``step >= warmup_steps``, with ``p`` as in :class:`WarmupCosine`::

        min_ratio + (1 - min_ratio) * (1 - p)
    """

    min_ratio: float = 0.0

    def _shape(self, progress: float) -> float:
        return _linear_shape(progress)


# A str mixin rather than enum.StrEnum (3.11+): the project supports Python 3.10.
class DecayShape(str, enum.Enum):
    """Shape of the WSD cooldown as a function of decay progress ``p`` in [0, 1]."""

    # Lower-case member names so that Hydra/OmegaConf accept `decay_shape: linear`.
    linear = "linear"  # 1 - p
    cosine = "cosine"  # 0.5 * (1 + cos(pi * p))
    sqrt = "sqrt"  # 1 - sqrt(p): drops fast early, the "1-sqrt" cooldown of Hägele et al.


_SHAPES: dict[DecayShape, Callable[[float], float]] = {
    DecayShape.linear: _linear_shape,
    DecayShape.cosine: _cosine_shape,
    DecayShape.sqrt: _sqrt_shape,
}


@dataclass(frozen=True)
class WSD(LRSchedule):
    """Warmup-stable-decay (MiniCPM; Hägele et al., 2024).

    The cooldown covers the last ``decay_steps = max(1, round(decay_fraction *
    total_steps))`` steps, ``[decay_start, total_steps - 1]`` with
    ``decay_start = total_steps - decay_steps``.  The multiplier is the warmup
    ramp, then 1 up to step ``decay_start - 1``, then with
    ``p = (step - decay_start + 1) / decay_steps``::

        min_ratio + (1 - min_ratio) * shape(p)

    where ``shape`` is given by ``decay_shape`` (see :class:`DecayShape`), so
    exactly ``decay_steps`` steps are below the peak and the last one is
    ``min_ratio``.  Warmup must end before the cooldown starts
    (``warmup_steps + decay_steps <= total_steps``).  When the cooldown
    follows the warmup directly (``decay_start == warmup_steps >= 1``) this
    equals :class:`WarmupLinear` / :class:`WarmupCosine` for the matching shape.
    """

    decay_fraction: float = 0.2
    min_ratio: float = 0.0
    decay_shape: DecayShape | str = DecayShape.linear

    @property
    def decay_steps(self) -> int:
        """Number of cooldown steps (the last of them at ``min_ratio``)."""
        return max(1, round(self.decay_fraction * self.total_steps))

    @property
    def decay_start(self) -> int:
        """First cooldown step, i.e. the first step below the stable LR."""
        return self.total_steps - self.decay_steps

    def _validate(self) -> None:
        _check_float("decay_fraction", self.decay_fraction, 0.0, 1.0, low_inclusive=False)
        _check_float("min_ratio", self.min_ratio, 0.0, 1.0)
        try:
            DecayShape(self.decay_shape)
        except ValueError:
            allowed = ", ".join(repr(s.value) for s in DecayShape)
            raise ValueError(
                f"decay_shape must be one of {allowed}, got {self.decay_shape!r}"
            ) from None

    def _max_warmup_steps(self) -> int:
        # Warmup must end before the cooldown starts; a longer one is a warning (LRSchedule.warmup_note).
        return self.decay_start

    def _after_warmup(self, step: int) -> float:
        # Anchored one step early so that decay_start itself is already decayed.
        progress = _progress(step, self.decay_start - 1, self.total_steps - 1)
        shape = _SHAPES[DecayShape(self.decay_shape)]  # accepts plain strings too
        return _interpolate(shape, progress, self.min_ratio)


@dataclass(frozen=True)
class InverseSqrt(LRSchedule):
    """Linear warmup, then inverse-square-root decay.

    With ``tau = timescale`` (default: ``max(warmup_steps, 1)``) and
    ``peak_step = max(warmup_steps - 1, 0)``, for ``step >= warmup_steps``::

        sqrt(tau / (tau + step - peak_step))

    which is 1 at ``peak_step`` (continuous with the warmup) and, with the
    default ``tau``, reduces to the classic
    ``sqrt(max(warmup_steps, 1) / (step + 1))``.  The decay does not depend on
    ``total_steps``; it keeps decaying past the end of the run.

    ``warmup_steps`` may be at most ``total_steps``; ``timescale`` must be > 0.
    """

    warmup_steps: int = 1000
    timescale: float | None = None

    @property
    def resolved_timescale(self) -> float:
        """The ``tau`` of the formula, after applying the default."""
        return max(self.warmup_steps, 1) if self.timescale is None else self.timescale

    def _validate(self) -> None:
        if self.timescale is not None:
            _check_float("timescale", self.timescale, 0.0, math.inf, low_inclusive=False)

    def _after_warmup(self, step: int) -> float:
        tau = self.resolved_timescale
        return math.sqrt(tau / (tau + step - self.peak_step))
