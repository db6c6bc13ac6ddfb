"""Precision plugins: how the forward runs (autocast), how the loss is scaled and how the step is taken."""

from plugins.precision.base import FP32Precision, FP32PrecisionConfig, Precision

__all__ = ["Precision", "FP32Precision", "FP32PrecisionConfig"]
