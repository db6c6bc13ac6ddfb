"""Precision plugins: how the forward runs (autocast), how the loss is scaled and how the step is taken.

`fp32` (the reference), `bf16` (bf16 autocast, fp32 master weights), `bf16_true` (bf16 weights,
optional fp32 master copy in the optimizer), `fp16` (fp16 autocast with dynamic loss scaling), `fp8` (bf16
mixed precision with float8 linear layers through torchao).
"""

from trainer.interfaces.precision import DTYPES, Precision
from trainer.plugins.precision.fp32 import FP32Precision
from trainer.plugins.precision.bf16_true import BF16True, FP32MasterWeights
from trainer.plugins.precision.configs import (
    PRECISION_SCHEMAS,
    BF16MixedConfig,
    BF16TrueConfig,
    Float8Config,
    FP16MixedConfig,
    FP32PrecisionConfig,
)
from trainer.plugins.precision.float8 import Float8
from trainer.plugins.precision.mixed import BF16Mixed, FP16Mixed, MixedPrecision
from trainer.plugins.precision.scaler import DynamicLossScaler

SCHEMAS = PRECISION_SCHEMAS  # the name every config family exports (trainer.config.registry)

__all__ = [
    "Precision", "FP32Precision", "MixedPrecision", "BF16Mixed", "FP16Mixed", "BF16True", "FP32MasterWeights",
    "DynamicLossScaler", "DTYPES", "PRECISION_SCHEMAS", "SCHEMAS",
    "FP32PrecisionConfig", "BF16MixedConfig", "BF16TrueConfig", "FP16MixedConfig", "Float8", "Float8Config",
]
