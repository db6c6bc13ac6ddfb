"""Mixed precision: fp32 parameters, gradients and optimizer states; matmuls in bf16 or fp16.

Under the replicating strategies (single, ddp, zero1) and tensor/pipeline parallelism the forward runs
under `torch.autocast` (which also works on DTensor operands); the fp32 parameters are the master
weights. Under FSDP2 (zero2, zero3, fsdp, the sharded 3d flavours, and 3d's `replicate`) the same
choice maps to a `MixedPrecisionPolicy`: the gathered parameters are cast to the compute dtype once per
block, the sharded fp32 parameters stay the master copy, and gradients are reduced (and, when
reduction is deferred, accumulated) in `reduce_dtype`. Autocast stays on there too, so ops that
autocast keeps in fp32 (softmax, norms of the loss) do so under every strategy.
"""

from __future__ import annotations

import math

import logging
from typing import Any, ContextManager, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.interfaces.precision import DTYPE_NAMES, Precision, dtype_from_name, gradients
from trainer.plugins.precision.scaler import DynamicLossScaler, agree_on_overflow, unscale_and_check_

log = logging.getLogger("trainer")


class MixedPrecision(Precision):
    """Autocast to `compute_dtype` around the forward; fp32 everywhere else."""

    compute_dtype: torch.dtype = torch.bfloat16

    def __init__(self, reduce_dtype: str = "fp32") -> None:
        super().__init__()
        # fp32, or the compute dtype (half the traffic): reducing in a third format only loses bits.
        allowed = ("fp32", DTYPE_NAMES[self.compute_dtype])
        self.reduce_dtype = dtype_from_name(reduce_dtype, f"precision={self.name}: precision.reduce_dtype", allowed)

    def autocast(self) -> ContextManager[Any]:
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    def fsdp_mixed_precision(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)


class BF16Mixed(MixedPrecision):
    """bf16 autocast, fp32 master weights and optimizer states (no loss scaling: bf16 has fp32's range)."""

    name = "bf16"
    compute_dtype = torch.bfloat16


class FP16Mixed(MixedPrecision):
    """fp16 autocast with dynamic loss scaling; fp32 master weights and optimizer states.

    Each step: the loss is multiplied by the scale before backward; `unscale_gradients` divides every
    gradient (local shards of DTensors included) by it and checks for inf/nan; the flag is reduced over
    all ranks, so every rank skips the same steps; the scale moves (`DynamicLossScaler`); on overflow
    `optimizer_step` leaves parameters and optimizer states untouched.
    """

    name = "fp16"
    compute_dtype = torch.float16
    skips_nonfinite_steps = True

    def __init__(self, reduce_dtype: str = "fp32", initial_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, hysteresis: int = 1,
                 min_scale: float = 1.0) -> None:
        super().__init__(reduce_dtype=reduce_dtype)
        # A power of two scales and unscales exactly (only the exponent changes); any other value rounds
        # every gradient twice.
        if not (initial_scale > 0 and math.isfinite(initial_scale) and math.log2(initial_scale).is_integer()):
            raise ValueError(f"precision.initial_scale must be a power of two (2**k: scaling is then exact), "
                             f"got {initial_scale:g}; e.g. {2.0 ** round(math.log2(initial_scale)) if initial_scale > 0 else 65536:g}")
        self.scaler = DynamicLossScaler(initial_scale=initial_scale, growth_factor=growth_factor,
                                        backoff_factor=backoff_factor, growth_interval=growth_interval,
                                        hysteresis=hysteresis, min_scale=min_scale)
        # The decision of the last unscale_gradients call (the current step's).
        self.found_inf = False
        self._warned_at_floor = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale

    def unscale_gradients(self, optimizer: torch.optim.Optimizer, model_parts: Sequence[nn.Module] = ()) -> None:
        scale = self.scaler.scale
        found = unscale_and_check_(gradients(optimizer, model_parts), 1.0 / scale)
        self.found_inf = agree_on_overflow(found)
        self.scaler.update(self.found_inf)
        if self.found_inf:
            log.info(f"fp16: inf/nan gradients, step skipped; loss scale {scale:g} -> {self.scaler.scale:g}")
            if scale == self.scaler.min_scale and not self._warned_at_floor:
                self._warned_at_floor = True
                log.warning(f"fp16: gradients overflow at the minimum loss scale {scale:g}: the loss itself is "
                            "not finite in fp16; steps keep being skipped (try precision=bf16)")

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.found_inf:
            return False
        self.step(optimizer)
        return True

    def metrics(self) -> dict[str, float]:
        return {"loss_scale": self.scaler.scale}

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
