"""Base class of the precision plugins.

Every hook is the identity for full fp32 training, so a plugin overrides only what its number format
changes (autocast region, loss scaling, the optimizer step that may be skipped on overflow).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch


class Precision:
    """Identity precision: parameters, activations, gradients and optimizer states in fp32."""

    name: str = "fp32"
    # dtype the parameters are stored in; the strategy casts the model to it before wrapping.
    param_dtype: torch.dtype = torch.float32
    # dtype the matmuls run in (the MFU reference peak depends on it).
    compute_dtype: torch.dtype = torch.float32

    def autocast(self) -> ContextManager[Any]:
        """Context entered around every forward pass."""
        return contextlib.nullcontext()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Loss actually back-propagated (a loss scaler multiplies it)."""
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before gradient clipping so that norms are measured in true units."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the step; return False when it was skipped (e.g. on fp16 overflow)."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class FP32Precision(Precision):
    """Plain fp32 training (the reference all other precisions are compared with)."""


@dataclass
class FP32PrecisionConfig:
    """Schema of `precision=fp32`."""

    _target_: str = "plugins.precision.FP32Precision"
