"""Precision plugins: how the forward runs (autocast), how the loss is scaled and how the step is taken.

`fp32` (the reference), `bf16` (bf16 autocast, fp32 master weights), `bf16_true` (bf16 weights,
optional fp32 master copy in the optimizer), `fp16` (fp16 autocast with dynamic loss scaling).
"""

from trainer.plugins.precision.base import DTYPES, FP32Precision, Precision
from trainer.plugins.precision.bf16_true import BF16True, FP32MasterWeights
from trainer.plugins.precision.compat import check_precision_strategy
from trainer.plugins.precision.configs import (
    PRECISION_SCHEMAS,
    BF16MixedConfig,
    BF16TrueConfig,
    FP16MixedConfig,
    FP32PrecisionConfig,
)
from trainer.plugins.precision.mixed import BF16Mixed, FP16Mixed, MixedPrecision
from trainer.plugins.precision.scaler import DynamicLossScaler

__all__ = [
    "Precision", "FP32Precision", "MixedPrecision", "BF16Mixed", "FP16Mixed", "BF16True", "FP32MasterWeights",
    "DynamicLossScaler", "check_precision_strategy", "DTYPES", "PRECISION_SCHEMAS",
    "FP32PrecisionConfig", "BF16MixedConfig", "BF16TrueConfig", "FP16MixedConfig",
]
