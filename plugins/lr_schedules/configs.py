"""Typed Hydra schemas for the ``lr_schedule`` config group.

Each schema mirrors the constructor of its schedule minus ``total_steps``,
which the trainer supplies once it knows the run length
(``instantiate(cfg)(total_steps=N)``); hence ``_partial_`` defaults to True.
``SCHEMAS`` (at the end) maps each option name to its schema; ``trainer.config.register_configs``
stores every entry in Hydra's ConfigStore as ``<name>_schema``, which the ``defaults`` list of
``conf/lr_schedule/<name>.yaml`` pulls in. A new schedule needs its class, its schema here (listed in
``SCHEMAS``) and that YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import DecayShape

__all__ = [
    "SCHEMAS",
    "ConstantScheduleConfig",
    "CosineScheduleConfig",
    "LinearScheduleConfig",
    "WSDScheduleConfig",
    "InverseSqrtScheduleConfig",
]


@dataclass
class ConstantScheduleConfig:
    """Schema of :class:`trainer.plugins.lr_schedules.Constant`."""

    _target_: str = "trainer.plugins.lr_schedules.Constant"
    # Must stay true: the trainer adds total_steps after instantiation.
    _partial_: bool = True
    # Linear-warmup updates before the LR reaches its base value; in [0, total_steps].
    warmup_steps: int = 0


@dataclass
class CosineScheduleConfig:
    """Schema of :class:`trainer.plugins.lr_schedules.WarmupCosine`."""

    _target_: str = "trainer.plugins.lr_schedules.WarmupCosine"
    # Must stay true: the trainer adds total_steps after instantiation.
    _partial_: bool = True
    # Linear-warmup updates; in [0, total_steps - 1].
    warmup_steps: int = 0
    # Final LR as a fraction of the base LR, reached at the last step; in [0, 1].
    min_ratio: float = 0.1


@dataclass
class LinearScheduleConfig:
    """Schema of :class:`trainer.plugins.lr_schedules.WarmupLinear`."""

    _target_: str = "trainer.plugins.lr_schedules.WarmupLinear"
    # Must stay true: the trainer adds total_steps after instantiation.
    _partial_: bool = True
    # Linear-warmup updates; in [0, total_steps - 1].
    warmup_steps: int = 0
    # Final LR as a fraction of the base LR, reached at the last step; in [0, 1].
    min_ratio: float = 0.0


@dataclass
class WSDScheduleConfig:
    """Schema of :class:`trainer.plugins.lr_schedules.WSD` (warmup-stable-decay)."""

    _target_: str = "trainer.plugins.lr_schedules.WSD"
    # Must stay true: the trainer adds total_steps after instantiation.
    _partial_: bool = True
    # Linear-warmup updates; must end before the decay phase starts.
    warmup_steps: int = 0
    # Fraction of total_steps spent in the final decay (cooldown), in (0, 1];
    # warmup_steps + round(decay_fraction * total_steps) must not exceed total_steps.
    decay_fraction: float = 0.2
    # Final LR as a fraction of the base LR, reached at the last step; in [0, 1].
    min_ratio: float = 0.0
    # Cooldown shape: linear, cosine or sqrt (1 - sqrt(progress)).
    decay_shape: DecayShape = DecayShape.linear


@dataclass
class InverseSqrtScheduleConfig:
    """Schema of :class:`trainer.plugins.lr_schedules.InverseSqrt`."""

    _target_: str = "trainer.plugins.lr_schedules.InverseSqrt"
    # Must stay true: the trainer adds total_steps after instantiation.
    _partial_: bool = True
    # Linear-warmup updates; in [0, total_steps].
    warmup_steps: int = 1000
    # Decay timescale tau in sqrt(tau / (tau + step - max(warmup_steps - 1, 0))), > 0;
    # null means max(warmup_steps, 1), i.e. the classic sqrt(warmup_steps / (step + 1)).
    timescale: float | None = None


# Option name (`lr_schedule=NAME`) -> schema.
SCHEMAS: dict[str, type] = {
    "constant": ConstantScheduleConfig,
    "cosine": CosineScheduleConfig,
    "linear": LinearScheduleConfig,
    "wsd": WSDScheduleConfig,
    "inverse_sqrt": InverseSqrtScheduleConfig,
}
