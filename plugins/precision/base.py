"""Base class of the precision plugins.

Every hook is the identity for full fp32 training, so a plugin overrides only what its number format
changes (autocast region, parameter dtype, loss scaling, the optimizer step that may be skipped on
overflow, FSDP's mixed-precision policy).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

# Names of the dtypes in configs and messages.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str, key: str, allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    """`fp32`/`bf16`/`fp16` (among `allowed`) -> torch dtype; ValueError naming the config key otherwise."""
    if name not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {name!r}")
    return DTYPES[name]


class Precision:
    """Identity precision: parameters, activations, gradients and optimizer states in fp32."""

    name: str = "fp32"
    # dtype the parameters are stored in; the strategy casts the model to it before wrapping.
    param_dtype: torch.dtype = torch.float32
    # dtype the matmuls run in (the MFU reference peak depends on it).
    compute_dtype: torch.dtype = torch.float32
    # dtype data-parallel gradient reductions should use (None: the gradients' own dtype).
    reduce_dtype: torch.dtype | None = None

    def __init__(self) -> None:
        # Set by the strategy once it knows the device (autocast needs the device type).
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def setup(self, device: torch.device) -> None:
        """Called by the strategy before the model is built on `device`."""
        self.device_type = device.type

    def check_strategy(self, strategy: Any, device_type: str) -> None:
        """Raise ValueError (one line naming both) when `strategy` cannot honour this precision.

        Called by `trainer.config.validate` before any process starts; the rules are in
        `trainer.plugins.precision.compat`.
        """
        from trainer.plugins.precision.compat import check_precision_strategy

        check_precision_strategy(self, strategy, device_type)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Called once when the run is assembled, before anything steps or loads the optimizer (bf16_true
        installs its fp32 master copies here)."""

    def optimizer_tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor the strategy gave the optimizer, the copy the optimizer steps in its place) pairs, so
        that a checkpoint can name the copy's optimizer states after the parameter. Empty by default."""
        return []

    def autocast(self) -> ContextManager[Any]:
        """Context entered around every forward pass."""
        return contextlib.nullcontext()

    def fsdp_mixed_precision(self) -> MixedPrecisionPolicy:
        """FSDP2's policy under the sharded strategies (zero2, zero3, fsdp, 3d): what the gathered
        parameters are cast to and what gradients are reduced in."""
        return MixedPrecisionPolicy()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Loss actually back-propagated (a loss scaler multiplies it)."""
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer, model_parts: Sequence[nn.Module] = ()) -> None:
        """Called once per step before gradient clipping, so that norms are measured in true units.

        `model_parts` are the modules whose parameters hold the gradients (the optimizer may step other
        tensors, e.g. ZeRO-1's sharded views, whose gradients are only attached at the step).
        """

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the step; return False when it was skipped (e.g. on fp16 overflow)."""
        optimizer.step()
        return True

    def metrics(self) -> dict[str, float]:
        """Values logged with every training step (e.g. the loss scale)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this plugin (loss scale, master weights)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class FP32Precision(Precision):
    """Plain fp32 training (the reference all other precisions are compared with)."""


def gradients(optimizer: torch.optim.Optimizer, model_parts: Sequence[nn.Module]) -> Iterator[torch.Tensor]:
    """Every gradient once: of the model parts' parameters, else of the optimizer's tensors."""
    seen: set[int] = set()
    if model_parts:
        params: Iterator[torch.Tensor] = (p for part in model_parts for p in part.parameters())
    else:
        params = (p for group in optimizer.param_groups for p in group["params"])
    for param in params:
        if param.grad is not None and id(param) not in seen:
            seen.add(id(param))
            yield param.grad
