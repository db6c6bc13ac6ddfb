"""True bf16: parameters, activations and gradients in bf16, optionally an fp32 master copy.

Without a master copy the optimizer updates bf16 weights directly (its states are bf16 too): an update
smaller than half a bf16 ulp of the weight (2^-9 relative) is lost, which stalls training at small
learning rates. With `master_weights=true` the optimizer steps fp32 copies of what it updates (and keeps
fp32 states) and the result is rounded into the bf16 parameters after each step: bf16 memory and speed
for the forward/backward, fp32 accumulation of updates.

Checkpoints hold the bf16 weights, the optimizer's (fp32) states and the fp32 master copies
(`optim.<fqn>.master_weight`, trainer/checkpoint/state.py), so a resume or a stabilizer rollback continues
exactly; a checkpoint without them (saved by another precision) restarts them from the loaded weights.
"""

from __future__ import annotations


import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.interfaces.precision import Precision, dtype_from_name
from trainer.optim import SteppedCopies


class FP32MasterWeights(SteppedCopies):
    """fp32 copies of the tensors an optimizer updates, stepped in their place (what `BF16True` installs
    through `Precision.setup_optimizer`)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, dtype=torch.float32)


class BF16True(Precision):
    """bf16 parameters and compute (no autocast needed: every operand is already bf16)."""

    name = "bf16_true"
    param_dtype = torch.bfloat16
    compute_dtype = torch.bfloat16

    def __init__(self, master_weights: bool = True, reduce_dtype: str = "bf16") -> None:
        super().__init__()
        self.master_weights = master_weights
        self.reduce_dtype = dtype_from_name(reduce_dtype, "precision=bf16_true: precision.reduce_dtype",
                                            ("bf16", "fp32"))

    def fsdp_mixed_precision(self) -> MixedPrecisionPolicy:
        # The sharded parameters are bf16 already; only the gradient reduction may be upcast.
        reduce = None if self.reduce_dtype == torch.bfloat16 else self.reduce_dtype
        return MixedPrecisionPolicy(reduce_dtype=reduce)
