"""Tests for trainer.plugins.lr_schedules: values, shape, validation, LambdaLR, Hydra configs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra.utils
import pytest
import torch
from omegaconf import OmegaConf

from trainer.plugins.lr_schedules import (
    WSD,
    Constant,
    ConstantScheduleConfig,
    CosineScheduleConfig,
    DecayShape,
    InverseSqrt,
    InverseSqrtScheduleConfig,
    LinearScheduleConfig,
    LRSchedule,
    WarmupCosine,
    WarmupLinear,
    WSDScheduleConfig,
)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "lr_schedule"


def values(schedule: LRSchedule, steps: range) -> list[float]:
    return [schedule(step) for step in steps]


def is_non_increasing(xs: list[float]) -> bool:
    return all(b <= a + 1e-12 for a, b in zip(xs[:-1], xs[1:], strict=True))


def is_non_decreasing(xs: list[float]) -> bool:
    return all(b >= a - 1e-12 for a, b in zip(xs[:-1], xs[1:], strict=True))


# ---------------------------------------------------------------------------
# Hand-computed values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 0.25), (1, 0.5), (3, 1.0), (4, 1.0), (99, 1.0), (10_000, 1.0)],
)
def test_constant_values(step: int, expected: float) -> None:
    assert Constant(total_steps=100, warmup_steps=4)(step) == pytest.approx(expected)


def test_constant_without_warmup_is_one_from_step_zero() -> None:
    assert values(Constant(total_steps=5), range(8)) == [1.0] * 8


def test_constant_warmup_may_span_whole_run() -> None:
    schedule = Constant(total_steps=4, warmup_steps=4)
    assert values(schedule, range(5)) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


# total_steps=21, warmup_steps=5, min_ratio=0.1: decay spans steps 4..20 (16 intervals).
@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.2),  # first warmup step is 1/warmup_steps, not 0
        (4, 1.0),  # last warmup step is the peak and the start of the decay
        (5, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 16))),  # first step after warmup
        (8, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),  # quarter-way
        (12, 0.55),  # midpoint of the decay: halfway between 1 and 0.1
        (20, 0.1),  # last step: exactly min_ratio
        (21, 0.1),  # beyond the end: held
        (1000, 0.1),
    ],
)
def test_cosine_values(step: int, expected: float) -> None:
    schedule = WarmupCosine(total_steps=21, warmup_steps=5, min_ratio=0.1)
    assert schedule(step) == pytest.approx(expected)


def test_cosine_hits_min_ratio_exactly() -> None:
    schedule = WarmupCosine(total_steps=300, warmup_steps=20, min_ratio=0.1)
    assert schedule(299) == 0.1


def test_cosine_without_warmup_starts_at_one() -> None:
    schedule = WarmupCosine(total_steps=11, min_ratio=0.0)
    assert schedule(0) == 1.0
    assert schedule(5) == pytest.approx(0.5)
    assert schedule(10) == 0.0


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 0.5), (1, 1.0), (2, 0.9), (3, 0.8), (6, 0.5), (10, 0.1), (11, 0.1), (50, 0.1)],
)
def test_linear_values(step: int, expected: float) -> None:
    # Decay spans steps 1..10 (9 intervals) from 1 to 0.1: -0.1 per step.
    schedule = WarmupLinear(total_steps=11, warmup_steps=2, min_ratio=0.1)
    assert schedule(step) == pytest.approx(expected)


def test_linear_default_decays_to_zero() -> None:
    schedule = WarmupLinear(total_steps=5)
    assert values(schedule, range(6)) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


# total_steps=100, warmup 10, decay_fraction 0.2: stable up to 79, cooldown 80..99.
@pytest.mark.parametrize(
    ("shape", "midpoint"),
    [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))],
)
def test_wsd_values(shape: str, midpoint: float) -> None:
    schedule = WSD(
        total_steps=100, warmup_steps=10, decay_fraction=0.2, min_ratio=0.0, decay_shape=shape
    )
    assert (schedule.decay_steps, schedule.decay_start) == (20, 80)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(9) == 1.0
    assert schedule(10) == 1.0
    assert schedule(79) == 1.0  # last stable step
    assert schedule(80) < 1.0  # all 20 cooldown steps are decayed
    assert schedule(89) == pytest.approx(midpoint)  # p = (89 - 79) / 20
    assert schedule(99) == 0.0
    assert schedule(150) == 0.0


def test_wsd_min_ratio_and_enum_shape() -> None:
    schedule = WSD(total_steps=10, decay_fraction=0.5, min_ratio=0.25, decay_shape=DecayShape.sqrt)
    assert schedule.decay_start == 5
    assert schedule(4) == 1.0
    assert schedule(7) == pytest.approx(0.25 + 0.75 * (1 - math.sqrt(3 / 5)))
    assert schedule(9) == 0.25


def test_wsd_sqrt_drops_faster_than_linear_early_in_cooldown() -> None:
    kwargs: dict[str, Any] = {"total_steps": 100, "decay_fraction": 0.5}
    sqrt, linear = WSD(**kwargs, decay_shape="sqrt"), WSD(**kwargs, decay_shape="linear")
    assert sqrt(55) < linear(55)


@pytest.mark.parametrize(
    ("shape", "reference"), [("cosine", WarmupCosine), ("linear", WarmupLinear)]
)
def test_wsd_with_full_decay_matches_warmup_decay_schedules(
    shape: str, reference: Callable[..., LRSchedule]
) -> None:
    # decay_fraction 0.9 of 50 steps: the cooldown starts right after the 5 warmup steps.
    wsd = WSD(total_steps=50, warmup_steps=5, decay_fraction=0.9, min_ratio=0.1, decay_shape=shape)
    ref = reference(total_steps=50, warmup_steps=5, min_ratio=0.1)
    assert values(wsd, range(60)) == pytest.approx(values(ref, range(60)))


def test_wsd_tiny_fraction_still_reaches_min_at_last_step() -> None:
    schedule = WSD(total_steps=10, decay_fraction=0.01, min_ratio=0.3)
    assert schedule.decay_steps == 1
    assert values(schedule, range(11)) == [1.0] * 9 + [0.3, 0.3]


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.25),
        (3, 1.0),  # end of warmup
        (4, math.sqrt(4 / 5)),  # sqrt(warmup / (step + 1)) with the default timescale
        (15, 0.5),
        (99, 0.2),
    ],
)
def test_inverse_sqrt_values(step: int, expected: float) -> None:
    assert InverseSqrt(total_steps=100, warmup_steps=4)(step) == pytest.approx(expected)


def test_inverse_sqrt_timescale() -> None:
    schedule = InverseSqrt(total_steps=100, warmup_steps=4, timescale=2)
    # sqrt(2 / (2 + step + 1 - 4))
    assert schedule(3) == 1.0
    assert schedule(5) == pytest.approx(math.sqrt(2 / 4))
    assert schedule(9) == pytest.approx(math.sqrt(2 / 8))


def test_inverse_sqrt_without_warmup() -> None:
    schedule = InverseSqrt(total_steps=10, warmup_steps=0)
    expected = [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5]  # 1 / sqrt(step + 1)
    assert values(schedule, range(4)) == pytest.approx(expected)


def test_inverse_sqrt_keeps_decaying_past_the_end() -> None:
    schedule = InverseSqrt(total_steps=10, warmup_steps=1)
    assert schedule(100) < schedule(10) < schedule(9)


@pytest.mark.parametrize("warmup", [1, 2, 7, 50])
def test_inverse_sqrt_continuous_at_end_of_warmup(warmup: int) -> None:
    schedule = InverseSqrt(total_steps=100, warmup_steps=warmup)
    assert schedule(warmup - 1) == 1.0
    # The first decay step is one ordinary decay increment below 1.
    assert schedule(warmup) == pytest.approx(math.sqrt(warmup / (warmup + 1)))


# ---------------------------------------------------------------------------
# Shape properties over all schedules
# ---------------------------------------------------------------------------

ALL_SCHEDULES: list[LRSchedule] = [
    Constant(total_steps=300, warmup_steps=20),
    WarmupCosine(total_steps=300, warmup_steps=20, min_ratio=0.1),
    WarmupLinear(total_steps=300, warmup_steps=20),
    WSD(total_steps=300, warmup_steps=20, decay_shape="linear"),
    WSD(total_steps=300, warmup_steps=20, decay_shape="cosine"),
    WSD(total_steps=300, warmup_steps=20, decay_shape="sqrt", min_ratio=0.05),
    InverseSqrt(total_steps=300, warmup_steps=20),
]


@pytest.mark.parametrize("schedule", ALL_SCHEDULES, ids=repr)
def test_warmup_rises_then_never_rises_again(schedule: LRSchedule) -> None:
    warmup = values(schedule, range(schedule.warmup_steps))
    after = values(schedule, range(schedule.warmup_steps - 1, 400))
    assert is_non_decreasing(warmup)
    assert warmup[0] == pytest.approx(1 / schedule.warmup_steps)
    assert after[0] == 1.0
    assert is_non_increasing(after)
    assert all(0.0 <= v <= 1.0 for v in warmup + after)


@pytest.mark.parametrize(
    "schedule",
    [
        WarmupCosine(total_steps=300, warmup_steps=20),
        WarmupLinear(total_steps=300, warmup_steps=20),
        WSD(total_steps=300, warmup_steps=20, decay_fraction=280 / 300),
        InverseSqrt(total_steps=300, warmup_steps=20),
    ],
    ids=repr,
)
def test_decay_right_after_warmup_does_not_repeat_the_peak(schedule: LRSchedule) -> None:
    assert schedule(schedule.warmup_steps - 1) == 1.0
    assert schedule(schedule.warmup_steps) < 1.0


@pytest.mark.parametrize("schedule", ALL_SCHEDULES[1:6], ids=repr)
def test_decaying_schedules_end_at_min_ratio(schedule: LRSchedule) -> None:
    min_ratio = schedule.min_ratio  # type: ignore[attr-defined]
    assert schedule(schedule.total_steps - 1) == min_ratio
    assert schedule(schedule.total_steps - 2) > min_ratio
    assert schedule(schedule.total_steps + 10) == min_ratio


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


# kwargs are added to total_steps=10.
@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (Constant, {"total_steps": 0}, r"total_steps must be in \[1, inf\), got 0"),
        (Constant, {"total_steps": 10.0}, r"total_steps must be an integer"),
        (Constant, {"total_steps": True}, r"total_steps must be an integer"),
        (Constant, {"warmup_steps": -1}, r"warmup_steps must be in \[0, inf\), got -1"),
        (WarmupCosine, {"min_ratio": 1.5}, r"min_ratio must be in \[0.0, 1.0\], got 1.5"),
        (WarmupCosine, {"min_ratio": -0.1}, r"min_ratio must be in \[0.0, 1.0\]"),
        (WarmupCosine, {"min_ratio": math.nan}, r"min_ratio must be in \[0.0, 1.0\]"),
        (WarmupLinear, {"min_ratio": "0.1"}, r"min_ratio must be a number in \[0.0, 1.0\]"),
        (WSD, {"decay_fraction": 0.0}, r"decay_fraction must be in \(0.0, 1.0\]"),
        (WSD, {"decay_fraction": 1.1}, r"decay_fraction must be in \(0.0, 1.0\]"),
        (WSD, {"min_ratio": 2.0}, r"min_ratio must be in \[0.0, 1.0\]"),
        (
            WSD,
            {"decay_shape": "exp"},
            r"decay_shape must be one of 'linear', 'cosine', 'sqrt', got 'exp'",
        ),
        (InverseSqrt, {"warmup_steps": 2, "timescale": 0}, r"timescale must be in \(0.0, inf\)"),
        (InverseSqrt, {"warmup_steps": 2, "timescale": math.inf}, r"timescale must be in"),
    ],
)
def test_invalid_arguments_raise(
    factory: Callable[..., LRSchedule], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        factory(**{"total_steps": 10, **kwargs})


@pytest.mark.parametrize(
    ("factory", "kwargs", "longest"),
    [
        (Constant, {"warmup_steps": 11}, 10),
        (WarmupCosine, {"warmup_steps": 10}, 9),
        (WarmupLinear, {"warmup_steps": 20}, 9),
        (WSD, {"warmup_steps": 9, "decay_fraction": 0.2}, 8),
        (InverseSqrt, {}, 10),
    ],
)
def test_warmup_longer_than_the_run_ramps_for_the_whole_run_with_a_note(
    factory: Callable[..., LRSchedule], kwargs: dict[str, Any], longest: int
) -> None:
    """A short smoke run with a production warmup runs; the LR ramps all along and the note says so."""
    schedule = factory(**{"total_steps": 10, **kwargs})
    warmup = schedule.warmup_steps
    assert [schedule(s) for s in range(min(10, warmup))] == [(s + 1) / warmup for s in range(min(10, warmup))]
    note = schedule.warmup_note()
    assert note is not None and "\n" not in note and f"at most {longest}" in note
    assert factory(**{"total_steps": 10, "warmup_steps": longest}).warmup_note() is None


@pytest.mark.parametrize("step", [-1, 1.5, True])
def test_invalid_step_raises(step: Any) -> None:
    with pytest.raises(ValueError, match="step must be a non-negative integer"):
        Constant(total_steps=10)(step)


def test_schedules_are_immutable() -> None:
    schedule = WarmupCosine(total_steps=10)
    with pytest.raises(AttributeError):
        schedule.total_steps = 20  # type: ignore[misc]


# ---------------------------------------------------------------------------
# LambdaLR integration
# ---------------------------------------------------------------------------


def lrs_under_lambda_lr(schedule: LRSchedule, base_lr: float, updates: int) -> list[float]:
    """LR used by each of the first ``updates`` optimizer updates under LambdaLR."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=base_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    used = []
    for _ in range(updates):
        used.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler.step()
    return used


def test_lambda_lr_uses_multiplier_of_step_k_for_update_k_plus_one() -> None:
    schedule = WarmupCosine(total_steps=10, warmup_steps=4, min_ratio=0.0)
    used = lrs_under_lambda_lr(schedule, base_lr=0.5, updates=10)
    # Warmup, then the cosine over steps 3..9 (6 intervals) starts right away.
    assert used[:5] == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.25 * (1 + math.cos(math.pi / 6))])
    assert used[-1] == 0.0
    assert used == pytest.approx([0.5 * schedule(k) for k in range(10)])


def test_lambda_lr_state_dict_round_trip() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WSD(total_steps=10))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()

    fresh_optimizer = torch.optim.SGD([param], lr=1.0)
    fresh = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, WSD(total_steps=99))
    fresh.load_state_dict(state)
    assert fresh.lr_lambdas[0] == WSD(total_steps=10)
    assert fresh.last_epoch == 3


# ---------------------------------------------------------------------------
# Hydra configs
# ---------------------------------------------------------------------------

YAML_SCHEMAS = {
    "constant": ConstantScheduleConfig,
    "cosine": CosineScheduleConfig,
    "linear": LinearScheduleConfig,
    "wsd": WSDScheduleConfig,
    "inverse_sqrt": InverseSqrtScheduleConfig,
}


def compose(name: str, overrides: dict[str, Any] | None = None) -> Any:
    """Mimic Hydra's defaults list: schema first, then the yaml, then overrides."""
    raw = OmegaConf.load(CONF_DIR / f"{name}.yaml")
    assert list(raw.pop("defaults")) == [f"{name}_schema", "_self_"]
    return OmegaConf.merge(OmegaConf.structured(YAML_SCHEMAS[name]), raw, overrides or {})


@pytest.mark.parametrize("name", sorted(YAML_SCHEMAS))
def test_yaml_composes_onto_schema_and_instantiates(name: str) -> None:
    cfg = compose(name)
    assert cfg._partial_ is True
    schedule = hydra.utils.instantiate(cfg)(total_steps=300)
    assert isinstance(schedule, LRSchedule)
    assert type(schedule).__name__ == cfg._target_.rsplit(".", 1)[1]
    assert schedule.warmup_steps == cfg.warmup_steps
    assert schedule(cfg.warmup_steps - 1) == 1.0
    assert 0.0 <= schedule(299) <= 1.0


def test_cosine_yaml_defaults_suit_tiny_run() -> None:
    schedule = hydra.utils.instantiate(compose("cosine"))(total_steps=300)
    assert schedule == WarmupCosine(total_steps=300, warmup_steps=20, min_ratio=0.1)


def test_wsd_yaml_override_of_decay_shape() -> None:
    schedule = hydra.utils.instantiate(compose("wsd", {"decay_shape": "sqrt"}))(total_steps=300)
    assert schedule.decay_shape == "sqrt"
    assert schedule(280) == pytest.approx(1 - math.sqrt((280 - 239) / 60))


def test_schema_rejects_unknown_decay_shape() -> None:
    with pytest.raises(Exception, match="decay_shape"):
        compose("wsd", {"decay_shape": "exp"})


def test_schema_rejects_unknown_option() -> None:
    with pytest.raises(Exception, match="min_lr"):
        compose("cosine", {"min_lr": 0.0})
