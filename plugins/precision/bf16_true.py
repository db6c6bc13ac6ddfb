"""True bf16: parameters, activations and gradients in bf16, optionally an fp32 master copy.

Without a master copy the optimizer updates bf16 weights directly (its states are bf16 too): an update
smaller than half a bf16 ulp of the weight (2^-9 relative) is lost, which stalls training at small
learning rates. With `master_weights=true` the optimizer steps fp32 copies of what it updates (and keeps
fp32 states) and the result is rounded into the bf16 parameters after each step: bf16 memory and speed
for the forward/backward, fp32 accumulation of updates.

Checkpoints hold the bf16 weights and the optimizer's (fp32) states; the master copies are not saved: a
resumed run restarts them from the bf16 weights (they differ by less than half a bf16 ulp).
"""

from __future__ import annotations


import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.plugins.precision.base import Precision, dtype_from_name
from trainer.plugins.precision.scaler import local_tensor


class FP32MasterWeights:
    """fp32 copies of the tensors an optimizer updates; the optimizer steps the copies.

    Installed by replacing the optimizer's parameter-group entries before its first step (its state is
    still empty then). Works for whatever tensors the strategy gave the optimizer: parameters, FSDP or
    tensor-parallel DTensor shards, ZeRO-1's sharded views (whose gradients are attached at the step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise RuntimeError("fp32 master weights must be installed before the optimizer's first step")
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            masters = []
            for tensor in group["params"]:
                master = tensor.detach().clone().to(torch.float32)
                self.pairs.append((tensor, master))
                masters.append(master)
            group["params"] = masters

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for tensor, master in self.pairs:
            # A parameter whose value is no longer its master's rounding was written from outside (a
            # checkpoint load, init_from, a rollback): its master restarts from it. Local shards only,
            # so no collective is needed (each rank refreshes what it holds).
            local, local_master = local_tensor(tensor), local_tensor(master)
            if not torch.equal(local_master.to(local.dtype), local):
                local_master.copy_(local)
            master.grad = None if tensor.grad is None else tensor.grad.to(torch.float32)
        optimizer.step()
        for tensor, master in self.pairs:
            tensor.copy_(master)  # rounds to bf16
            master.grad = None


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
        self.masters: FP32MasterWeights | None = None

    def fsdp_mixed_precision(self) -> MixedPrecisionPolicy:
        # The sharded parameters are bf16 already; only the gradient reduction may be upcast.
        reduce = None if self.reduce_dtype == torch.bfloat16 else self.reduce_dtype
        return MixedPrecisionPolicy(reduce_dtype=reduce)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.master_weights and self.masters is None:
            self.masters = FP32MasterWeights(optimizer)

    def optimizer_tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(self.masters.pairs) if self.masters is not None else []

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        self.setup_optimizer(optimizer)  # for callers that did not (the Trainer does, at construction)
        if self.masters is None:
            optimizer.step()
        else:
            self.masters.step(optimizer)
        return True
