"""Sharded data parallelism with FSDP2 (`fully_shard`): ZeRO-2, ZeRO-3 and FSDP with hybrid sharding.

The three are one implementation at different points:
- `zero2` = `shard_grad_op`: gradients and optimizer states sharded; parameters are gathered once per
  step and kept through the backward (no re-gather), sharded again after it.
- `zero3` = `full_shard`: parameters too are freed after each block's forward and gathered again for
  its backward, block by block, with the next block's gather prefetched.
- `fsdp` exposes all modes, including `hybrid_shard`: shard inside groups of ranks, replicate across
  them (a 2-D replicate x shard mesh).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from trainer.plugins.precision import Precision
from trainer.plugins.strategies.distributed import DistributedStrategy

log = logging.getLogger("trainer")
SHARDING_MODES = ("full_shard", "shard_grad_op", "hybrid_shard")


class FSDP(DistributedStrategy):
    """FSDP2 over the data-parallel ranks; one `fully_shard` unit per transformer block plus the root."""

    name = "fsdp"

    def __init__(self, sharding: str = "full_shard", dp_replicate: Optional[int] = None, prefetch_blocks: int = 1,
                 reshard_after_forward: Optional[bool] = None, offload_params: bool = False,
                 offload_optimizer: bool = False, init: str = "auto", name: Optional[str] = None) -> None:
        super().__init__(init=init, name=name)
        if sharding not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}, got {sharding!r}")
        if prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be >= 0, got {prefetch_blocks}")
        if sharding == "hybrid_shard" and dp_replicate is not None and dp_replicate < 2:
            raise ValueError("hybrid_shard needs dp_replicate >= 2 (with 1 it is full_shard)")
        self.sharding = sharding
        self.dp_replicate = dp_replicate
        self.prefetch_blocks = prefetch_blocks
        self.reshard_after_forward = (sharding != "shard_grad_op" if reshard_after_forward is None
                                      else reshard_after_forward)
        self.offload = offload_params or offload_optimizer
        self._offload_noted = False

    def data_parallel_split(self, dp: int) -> tuple[int, int]:
        if self.sharding != "hybrid_shard":
            return 1, dp
        replicate = self.dp_replicate or self.default_replicate(dp)
        if dp % replicate or replicate in (1, dp):
            raise ValueError(f"hybrid_shard needs dp = dp_replicate x dp_shard with both >= 2; "
                             f"dp={dp} and dp_replicate={replicate} do not factor that way")
        return replicate, dp // replicate

    @staticmethod
    def default_replicate(dp: int) -> int:
        """Without an explicit size: the smallest factor >= 2 (across nodes on a real cluster, set
        strategy.dp_replicate=NUM_NODES so that shards stay inside a node)."""
        return next((f for f in range(2, dp) if dp % f == 0), dp)

    def offload_policy(self) -> OffloadPolicy:
        if not self.offload:
            return OffloadPolicy()
        if self.device.type == "cpu":
            if not self._offload_noted and self.is_global_zero:
                log.warning("offload: the weights and optimizer states already live in CPU memory; "
                            "offloading changes nothing here and is skipped")
            self._offload_noted = True
            return OffloadPolicy()
        # FSDP2 offloads the sharded parameters, their gradients and the optimizer step together.
        return CPUOffloadPolicy(pin_memory=True)

    def mixed_precision_policy(self, precision: Precision) -> MixedPrecisionPolicy:
        policy = getattr(precision, "fsdp_mixed_precision", None)
        return policy() if callable(policy) else MixedPrecisionPolicy()

    def wrap_data_parallel(self, model: nn.Module, precision: Precision) -> nn.Module:
        return wrap_fsdp(model, self.dims.fsdp_mesh(), mp_policy=self.mixed_precision_policy(precision),
                         offload_policy=self.offload_policy(), reshard_after_forward=self.reshard_after_forward,
                         prefetch_blocks=self.prefetch_blocks)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard changes the class in place, not the module tree


def wrap_fsdp(model: nn.Module, mesh: DeviceMesh | None, *, mp_policy: MixedPrecisionPolicy,
              offload_policy: OffloadPolicy, reshard_after_forward: bool, prefetch_blocks: int) -> nn.Module:
    """FSDP2 over `mesh` (1-D: shard; 2-D: replicate x shard): one unit per transformer block, then the
    root (embedding, final norm, head). Parameters that are already tensor-parallel DTensors become 2-D."""
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    blocks = list(model.layers.values())  # type: ignore[union-attr]
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by the backward: keep them.
        reshard = reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    _set_prefetch(blocks, prefetch_blocks)
    return model


def _set_prefetch(blocks: list[nn.Module], prefetch_blocks: int) -> None:
    """Gather the next `prefetch_blocks` blocks while the current one computes (both directions).

    FSDP2 already prefetches one block in backward on its own; setting it explicitly also covers the
    forward and allows deeper prefetch when memory allows.
    """
    for index, block in enumerate(blocks if prefetch_blocks else []):
        following = blocks[index + 1:index + 1 + prefetch_blocks]
        preceding = blocks[max(0, index - prefetch_blocks):index][::-1]
        if following:
            block.set_modules_to_forward_prefetch(following)  # type: ignore[operator]
        if preceding:
            block.set_modules_to_backward_prefetch(preceding)  # type: ignore[operator]


@dataclass
class FSDPConfig:
    """Schema of `strategy=fsdp` (and, with other defaults, of zero2 and zero3)."""

    _target_: str = "trainer.plugins.strategies.FSDP"
    name: str = "fsdp"
    # full_shard (ZeRO-3), shard_grad_op (ZeRO-2) or hybrid_shard (shard in groups, replicate across).
    sharding: str = "full_shard"
    # hybrid_shard: number of replicas (null: nodes on a cluster should set it; locally the smallest factor).
    dp_replicate: Optional[int] = None
    # Blocks whose parameters are gathered ahead of use (0: FSDP's own backward prefetch only).
    prefetch_blocks: int = 1
    # Free gathered parameters after each block's forward (null: true for full/hybrid, false for
    # shard_grad_op).
    reshard_after_forward: Optional[bool] = None
    # Keep the sharded parameters (and with them gradients and the optimizer step) in CPU memory.
    offload_params: bool = False
    # Run the optimizer on CPU; FSDP2 does this together with offload_params (same effect).
    offload_optimizer: bool = False
    # Weight initialization: full (whole model on every rank, then sharded: bitwise the single-process
    # weights), sharded (each rank initializes its shards: for models too big for host memory) or auto.
    init: str = "auto"
