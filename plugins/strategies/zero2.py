"""`strategy=zero2`: ZeRO stage 2 as the paper defines it (Rajbhandari et al. 2020).

Every data-parallel rank holds the whole parameters (as DDP does) and only its partition of the gradients
and optimizer states. The backward accumulates local gradients over the micro-batches without any
communication; after the last one, the gradients are reduce-scattered once into each rank's rows
(`ShardedGradients`), the optimizer steps those rows, and one all-gather brings every rank the rows the
others updated. Per rank, after a step: parameters = DDP's, gradients and optimizer states = DDP's / dp.

FSDP2's variant that keeps parameters sharded between steps and gathers them for every micro-batch is
`strategy=fsdp strategy.sharding=shard_grad_op`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from trainer.plugins.strategies.ddp import ShardedGradients
from trainer.plugins.strategies.distributed import DistributedStrategy


class ZeRO2(DistributedStrategy):
    """Replicated parameters; gradients and optimizer states partitioned over the data-parallel ranks."""

    name = "zero2"
    supports_ep = True

    def __init__(self, bucket_cap_mb: float = 25.0, offload_params: bool = False, offload_optimizer: bool = False,
                 init: str = "auto", name: str | None = None) -> None:
        super().__init__(init=init, name=name)
        if offload_params:
            raise ValueError("strategy=zero2 keeps the parameters on every rank's device by definition; "
                             "offloading parameters is zero3's (strategy=zero3 strategy.offload_params=true)")
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb
        self.offload_optimizer = offload_optimizer
        self.sharded: ShardedGradients | None = None

    @property
    def optimizer_host(self) -> torch.device | None:
        # ZeRO-Offload (Ren et al. 2021) is this: ZeRO-2 with the partitioned optimizer states, fp32
        # masters and step in host memory; on a CPU run the copies sit in the same memory
        return torch.device("cpu") if self.offload_optimizer else None

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        return {**super().planner_layout(dp, tp, pp, cp), "dp_flavour": "zero2" if dp * cp > 1 else "none",
                "bucket_cap_mb": float(self.bucket_cap_mb), "offload_optimizer": self.offload_optimizer}

    def full_init(self, model: nn.Module) -> bool:
        return True  # every rank holds the whole model; the same seed gives every rank the same weights

    def make_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        self.sharded = ShardedGradients(self.dims.dp_cp_mesh(), self.device,  # type: ignore[arg-type]
                                        bucket_cap_mb=self.bucket_cap_mb, reduce_dtype=self.precision.reduce_dtype,
                                        expert_mesh=self.dims.edp_mesh(),
                                        expert_params=self.expert_parameters(model_parts))
        return self.sharded.build_optimizer(optimizer_cfg, model_parts)

    def optimizer_tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.sharded.optimizer_tensor_pairs() if self.sharded is not None else []

    def reduce_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        """Once per optimizer step, after the last micro-batch (`DistributedStrategy.forward_backward`)."""
        assert self.sharded is not None, "build_optimizer() first"
        self.sharded.reduce_scatter_gradients()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer, model_parts: Sequence[nn.Module]) -> None:
        # the gradients now live on the optimizer's row views, not on the parameters
        self.precision.unscale_gradients(optimizer, ())

    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        assert self.sharded is not None
        views = [view for view in self.sharded.views() if view.grad is not None]
        if self.dims.ep_enabled:
            # Expert rows are partitioned over edp within each ep rank, the others over dp x cp: either way
            # each row lives on exactly one rank of dp x cp, so the squares summed over dp x cp are the norm's.
            squared = sum((view.grad.to_local().float().square().sum() for view in views),
                          torch.zeros((), device=self.device))
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.dims.dp_cp_mesh().get_group())  # type: ignore[union-attr]
            total = squared.sqrt()
            coef = min(1.0, max_norm / (float(total) + 1e-6)) if max_norm > 0 else 1.0
            if coef < 1.0:
                with torch.no_grad():
                    for view in views:
                        view.grad.mul_(coef)
            return total
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(views, max_norm, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([view.grad for view in views], foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        assert self.sharded is not None, "build_optimizer() first"
        return self.sharded.optimizer_step(optimizer, self.precision)


@dataclass
class ZeRO2Config:
    """Schema of `strategy=zero2` (textbook ZeRO-2: replicated parameters, partitioned gradients and
    optimizer states; FSDP2's shard_grad_op is `strategy=fsdp strategy.sharding=shard_grad_op`)."""

    _target_: str = "trainer.plugins.strategies.ZeRO2"
    name: str = "zero2"
    # Gradients are reduce-scattered in buckets of at most this size (bounds the transient buffer).
    bucket_cap_mb: float = 25.0
    # zero2 keeps the parameters on the device by definition; listed so that asking for it is refused
    # with an explanation rather than an unknown-key error.
    offload_params: bool = False
    # ZeRO-Offload: this rank's optimizer states (and fp32 masters) in host memory, stepped there.
    offload_optimizer: bool = False
    # Weight initialization: auto, full or sharded (every rank holds the whole model: full).
    init: str = "auto"
