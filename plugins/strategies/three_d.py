"""3D parallelism: pipeline x data x tensor parallel, with any data-parallel flavour.

`strategy=3d tp=2 pp=2 trainer.devices=8` derives dp = 8 / (2 x 2) = 2. Each rank holds its pipeline
stage(s); every stage part goes through the fixed order tensor parallel -> activation checkpointing ->
compile -> data-parallel wrapping, where the data-parallel flavour is any of the data-parallel
strategies: ddp, zero1 (ddp + sharded optimizer states), zero2, zero3, fsdp or hybrid_shard.
The replicating flavours use torch's `replicate` (DDP semantics on FSDP2's machinery): the classic
DistributedDataParallel breaks inside pipeline schedules (its reducer counts parameters twice when it
rebuilds buckets), and `replicate` also takes tensor-parallel DTensor parameters as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.plugins.precision import Precision
from trainer.plugins.strategies.ddp import ShardedOptimizerStates
from trainer.plugins.strategies.fsdp import FSDP, wrap_fsdp
from trainer.plugins.strategies.pipeline import PipelineParallel
from trainer.plugins.strategies.tensor_parallel import TensorParallel, settle_tensor_parallel_grads

DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hybrid_shard")
REPLICATING = ("ddp", "zero1")


def wrap_replicate(model: nn.Module, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy) -> nn.Module:
    """Replicated data parallelism per transformer block and the root, gradients all-reduced."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in model.layers.values():  # type: ignore[union-attr]
        replicate(block, mesh=mesh, mp_policy=mp_policy)
    replicate(model, mesh=mesh, mp_policy=mp_policy)
    return model


class ThreeD(PipelineParallel, TensorParallel, ShardedOptimizerStates):
    """Pipeline stages of tensor-parallel blocks, replicated or sharded over the data-parallel ranks.

    ShardedOptimizerStates comes last: the cooperative super() chains of the other bases end before it,
    and its ZeRO-1 optimizer is used explicitly when data_parallel=zero1.
    """

    name = "3d"
    uses_dp = True
    uses_tp = True
    uses_pp = True

    def __init__(self, data_parallel: str = "fsdp", *, dp_replicate: Optional[int] = None, prefetch_blocks: int = 1,
                 offload_params: bool = False, offload_optimizer: bool = False,
                 **pipeline_and_tensor_options: Any) -> None:
        super().__init__(**pipeline_and_tensor_options)
        if data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {', '.join(DATA_PARALLEL)}, got {data_parallel!r}")
        if data_parallel in REPLICATING and (offload_params or offload_optimizer):
            raise ValueError(f"data_parallel={data_parallel} cannot offload (every data-parallel rank keeps "
                             "its whole stage); offloading needs data_parallel=zero2, zero3, fsdp or hybrid_shard")
        self.data_parallel = data_parallel
        sharding = {"zero2": "shard_grad_op", "hybrid_shard": "hybrid_shard"}.get(data_parallel, "full_shard")
        # The FSDP options and checks, reused as they are for the sharded flavours.
        self._fsdp = FSDP(sharding=sharding, dp_replicate=dp_replicate, prefetch_blocks=prefetch_blocks,
                          offload_params=offload_params, offload_optimizer=offload_optimizer)

    @property
    def replicating(self) -> bool:
        return self.data_parallel in REPLICATING

    def data_parallel_split(self, dp: int) -> tuple[int, int]:
        return (dp, 1) if self.replicating else self._fsdp.data_parallel_split(dp)

    def wrap_data_parallel(self, model: nn.Module, precision: Precision) -> nn.Module:
        if not self.dims.dp_enabled:
            return model
        if self.replicating:
            # DDP semantics on FSDP2's machinery (`replicate`): unlike DistributedDataParallel it works
            # inside pipeline schedules and with tensor-parallel DTensor parameters.
            return wrap_replicate(model, self.dims.dp_mesh(), self._fsdp.mixed_precision_policy(precision))
        self._fsdp.device = self.device
        self._fsdp.rank = self.rank
        return wrap_fsdp(model, self.dims.fsdp_mesh(), mp_policy=self._fsdp.mixed_precision_policy(precision),
                         offload_policy=self._fsdp.offload_policy(),
                         reshard_after_forward=self._fsdp.reshard_after_forward,
                         prefetch_blocks=self._fsdp.prefetch_blocks)

    def build_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        if self.data_parallel == "zero1" and self.dims.dp_enabled:
            return ShardedOptimizerStates.build_optimizer(self, optimizer_cfg, self.optimizer_modules(model_parts))
        return super().build_optimizer(optimizer_cfg, model_parts)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        if self.data_parallel == "zero1" and self.dims.dp_enabled:
            return ShardedOptimizerStates.optimizer_step(self, optimizer, precision)  # type: ignore[arg-type]
        return super().optimizer_step(optimizer, precision)

    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        # sequence-parallel norm weights hold partial gradients: reduce them before any norm is taken
        settle_tensor_parallel_grads(model_parts)
        return super().clip_grad_norm(model_parts, max_norm)


@dataclass
class ThreeDConfig:
    """Schema of `strategy=3d` (pipeline x data x tensor parallel; sizes from the top-level pp, dp, tp)."""

    _target_: str = "trainer.plugins.strategies.three_d.ThreeD"
    name: str = "3d"
    # Data-parallel flavour: ddp, zero1, zero2, zero3, fsdp or hybrid_shard.
    data_parallel: str = "fsdp"
    # hybrid_shard: number of replicas (null: the smallest factor of dp).
    dp_replicate: Optional[int] = None
    # FSDP flavours: blocks gathered ahead of use.
    prefetch_blocks: int = 1
    # FSDP flavours: sharded parameters and the optimizer step in CPU memory.
    offload_params: bool = False
    offload_optimizer: bool = False
    # Pipeline: schedule (gpipe, 1f1b, interleaved_1f1b, zero_bubble), stages per rank, layer split.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    layers_per_stage: Optional[list[int]] = None
    embedding_weight: float = 1.0
    head_weight: float = 1.0
    # Tensor parallel: sequence parallelism for norms/residuals, vocab-parallel loss.
    sequence_parallel: bool = True
    loss_parallel: bool = True
    # Weight initialization: auto, full or sharded.
    init: str = "auto"
