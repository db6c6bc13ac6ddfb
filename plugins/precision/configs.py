"""Schemas of the precision options (`conf/precision/*.yaml`), registered as `<name>_schema`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FP32PrecisionConfig:
    """Schema of `precision=fp32`."""

    _target_: str = "trainer.plugins.precision.FP32Precision"


@dataclass
class BF16MixedConfig:
    """Schema of `precision=bf16`: bf16 autocast, fp32 master weights and optimizer states."""

    _target_: str = "trainer.plugins.precision.BF16Mixed"
    # dtype of data-parallel gradient reduction (and of accumulation while FSDP defers it): fp32, or bf16
    # to halve the traffic. Honoured by the FSDP2 strategies (zero2, zero3, fsdp, 3d); ddp/zero1 reduce
    # the fp32 gradients as they are (their bf16 option is strategy.comm_hook=bf16).
    reduce_dtype: str = "fp32"


@dataclass
class BF16TrueConfig:
    """Schema of `precision=bf16_true`: bf16 parameters, activations and gradients."""

    _target_: str = "trainer.plugins.precision.BF16True"
    # The optimizer steps fp32 copies of the weights (and keeps fp32 states); without it updates smaller
    # than bf16's resolution are lost.
    master_weights: bool = True
    # dtype of data-parallel gradient reduction: bf16 (the gradients' dtype), or fp32 (FSDP2
    # strategies only: ddp/zero1 all-reduce gradients in their own dtype).
    reduce_dtype: str = "bf16"


@dataclass
class FP16MixedConfig:
    """Schema of `precision=fp16`: fp16 autocast with dynamic loss scaling, fp32 master weights."""

    _target_: str = "trainer.plugins.precision.FP16Mixed"
    # dtype of data-parallel gradient reduction under FSDP2 strategies: fp32 (safe) or fp16.
    reduce_dtype: str = "fp32"
    # Loss scale at step 0.
    initial_scale: float = 65536.0
    # The scale is multiplied by growth_factor after growth_interval consecutive steps without overflow.
    growth_factor: float = 2.0
    growth_interval: int = 2000
    # On overflow the step is skipped and the scale multiplied by backoff_factor...
    backoff_factor: float = 0.5
    # ...once this many consecutive steps overflowed (1: every overflow backs off).
    hysteresis: int = 1
    # The scale never goes below this.
    min_scale: float = 1.0


@dataclass
class Float8Config:
    """Schema of `precision=fp8`: bf16 mixed precision whose linear layers multiply in float8 (torchao)."""

    _target_: str = "trainer.plugins.precision.Float8"
    # Scaling: tensorwise (one scale per tensor, fastest), rowwise, or rowwise_with_gw_hp (the weight
    # gradient's matmul in high precision).
    recipe: str = "tensorwise"
    # Run float8 numerics without float8 hardware (torchao casts and scales, multiplies in high precision):
    # for CPUs and GPUs older than compute capability 8.9, where fp8 is refused otherwise. No speed-up.
    emulate: bool = False
    # FSDP2 strategies with the tensorwise recipe: all-gather the weights in float8 (half of bf16's bytes).
    fsdp_float8_all_gather: bool = True
    # Linear layers kept in high precision, by name (the output layer, as torchtitan does).
    skip: list[str] = field(default_factory=lambda: ["output"])
    # dtype of data-parallel gradient reduction (as for precision=bf16).
    reduce_dtype: str = "fp32"


# name -> schema, registered in Hydra's ConfigStore by trainer.config.register_configs.
PRECISION_SCHEMAS: dict[str, type] = {
    "fp32": FP32PrecisionConfig,
    "bf16": BF16MixedConfig,
    "bf16_true": BF16TrueConfig,
    "fp16": FP16MixedConfig,
    "fp8": Float8Config,
}
