"""Sharded data parallelism with FSDP2 (`fully_shard`): ZeRO-3 and FSDP's other modes.

One implementation at different points:
- `fsdp sharding=shard_grad_op`: gradients and optimizer states sharded; parameters are sharded at rest,
  gathered once per micro-batch and kept through its backward (no re-gather). Textbook ZeRO-2, whose
  parameters stay whole on every rank, is `strategy=zero2` (plugins/strategies/zero2.py).
- `zero3` = `full_shard`: parameters too are freed after each block's forward and gathered again for
  its backward, block by block, with the next block's gather prefetched.
- `fsdp` exposes all modes, including `hybrid_shard`: shard inside groups of ranks, replicate across
  them (a 2-D replicate x shard mesh).

FSDP2's options are one dataclass, `FSDPOptions`, for every strategy that shards with FSDP2: the schemas of
`strategy=fsdp` / `zero3` (`FSDPConfig`) and of `strategy=3d` (`ThreeDConfig`) inherit its fields, so the
user-facing keys stay flat (`strategy.grad_sync=step`), and each strategy turns them into one `FSDPOptions`
that it hands whole to an `FSDPSharding` (the options with a sharding mode, and everything that follows
from them: the data-parallel split, the wrapping, the accumulation controls, the planner's fields).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Optional, Sequence, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from trainer.interfaces.strategy import MicroBatch
from trainer.models import family_of
from trainer.plugins.strategies.distributed import DistributedStrategy

log = logging.getLogger("trainer")
SHARDING_MODES = ("full_shard", "shard_grad_op", "hybrid_shard")
GRAD_SYNC_MODES = ("auto", "microbatch", "step")


@dataclass
class FSDPOptions:
    """FSDP2's options, the one definition for `strategy=fsdp`, `zero3` and the sharded data-parallel flavours
    of `strategy=3d` (their schemas inherit these fields; the strategies hold one instance).

    Plain values, checked on construction; what follows from them together with a sharding mode (the
    defaults left as null) is `FSDPSharding`'s. Nothing is written back, so the object a strategy holds
    reads as the config that made it."""

    # hybrid_shard: number of replicas (null: nodes on a cluster should set it, strategy.dp_replicate=NUM_NODES,
    # so that shards stay inside a node; locally the smallest factor of dp >= 2).
    dp_replicate: Optional[int] = None
    # Blocks whose parameters are gathered ahead of use, in forward and backward (0: FSDP2's own backward
    # prefetch of one block only).
    prefetch_blocks: int = 1
    # Free the gathered parameters after each block's forward and gather them again for its backward
    # (null: true for full_shard and hybrid_shard, false for shard_grad_op).
    reshard_after_forward: Optional[bool] = None
    # With reshard_after_forward: free the last block's parameters after its forward too (false: keep them,
    # since the backward starts with that block and would gather them again at once).
    reshard_last_block: bool = False
    # Sharded parameters, their gradients and the optimizer step in host memory (FSDP2's CPUOffloadPolicy).
    offload_params: bool = False
    # Only the optimizer: this rank's optimizer states (and fp32 masters) in host memory, stepped there;
    # parameters and the forward/backward stay on the device (ZeRO-Offload). Implied by offload_params.
    offload_optimizer: bool = False
    # Gradient accumulation: reduce-scatter after every micro-batch's backward ("microbatch": only a
    # gradient shard is ever held), once per optimizer step ("step": a whole gradient accumulates on every
    # rank and one reduce-scatter sums it), or "auto": step when the planner finds that the whole gradient and
    # parameters fit this device's memory (less plan.headroom), else microbatch. The run settles auto before
    # it builds the strategy (trainer.run.settle_grad_sync), logs the choice and writes it into config.yaml;
    # a strategy built with auto (the planner, validation) reduces per micro-batch.
    grad_sync: str = "auto"
    # Gradient accumulation: free the gathered parameters after each micro-batch's backward (true) or keep
    # them for the next micro-batch's forward (false: one all-gather fewer per block and micro-batch, the
    # whole parameters held in between). The last micro-batch always frees them. null: false with
    # grad_sync=step (the whole gradient is held anyway), true with microbatch; settled together with
    # grad_sync=auto (leave it null).
    reshard_after_backward: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be >= 0, got {self.prefetch_blocks}")
        if self.grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync must be one of {', '.join(GRAD_SYNC_MODES)}, got {self.grad_sync!r}")
        if self.grad_sync == "auto" and self.reshard_after_backward is not None:
            raise ValueError("reshard_after_backward is chosen together with grad_sync=auto; set grad_sync=step "
                             "or grad_sync=microbatch to set it yourself")


class FSDPSharding:
    """FSDP2 as a strategy applies it: a sharding mode (`strategy.sharding` of fsdp/zero3, the sharded
    `data_parallel` flavours of 3d) with its `FSDPOptions`, and what follows from the two: the data-parallel
    split, the wrapping, the accumulation controls, offloading and the planner's fields. `strategy=fsdp` and
    `strategy=3d` both go through it, so an option cannot reach one and miss the other."""

    def __init__(self, mode: str, options: FSDPOptions) -> None:
        if mode not in SHARDING_MODES:
            raise ValueError(f"sharding must be one of {', '.join(SHARDING_MODES)}, got {mode!r}")
        if mode == "hybrid_shard" and options.dp_replicate is not None and options.dp_replicate < 2:
            raise ValueError("hybrid_shard needs dp_replicate >= 2 (with 1 it is full_shard)")
        self.mode = mode
        self.options = options
        self._offload_noted = False

    @property
    def reshard_after_forward(self) -> bool:
        """The options' setting, or the mode's default: only shard_grad_op keeps parameters for the backward."""
        if self.options.reshard_after_forward is not None:
            return self.options.reshard_after_forward
        return self.mode != "shard_grad_op"

    @property
    def reshard_after_backward(self) -> bool:
        """The options' setting, or false with grad_sync=step (the whole gradient is held anyway) and true
        otherwise (an unsettled auto acts as microbatch: FSDP2's defaults)."""
        if self.options.reshard_after_backward is not None:
            return self.options.reshard_after_backward
        return self.options.grad_sync != "step"

    def data_parallel_split(self, dp: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard): shard over all `dp` ranks, or replicate x shard for hybrid_shard."""
        if self.mode != "hybrid_shard":
            return 1, dp
        replicate = self.options.dp_replicate or self.default_replicate(dp)
        if dp % replicate or replicate in (1, dp):
            raise ValueError(f"hybrid_shard needs dp = dp_replicate x dp_shard with both >= 2; "
                             f"dp={dp} and dp_replicate={replicate} do not factor that way")
        return replicate, dp // replicate

    @staticmethod
    def default_replicate(dp: int) -> int:
        """Without an explicit size: the smallest factor >= 2 (across nodes on a real cluster, set
        strategy.dp_replicate=NUM_NODES so that shards stay inside a node)."""
        return next((f for f in range(2, dp) if dp % f == 0), dp)

    @property
    def dp_flavour(self) -> str:
        """What the planner calls this sharding: shard_grad_op (parameters kept gathered between forward
        and backward), zero3 or hybrid_shard."""
        if self.mode == "hybrid_shard":
            return "hybrid_shard"
        return "zero3" if self.reshard_after_forward else "shard_grad_op"

    def backward_sync(self, model: nn.Module, last_microbatch: bool) -> ContextManager[None]:
        """FSDP2's gradient-sync and reshard controls for one micro-batch of an accumulating step (the
        controls torch.distributed.pipelining sets around its micro-batches)."""
        sync = self.options.grad_sync != "step"  # an unsettled auto reduces per micro-batch
        if sync and self.reshard_after_backward:
            return contextlib.nullcontext()
        return accumulation_flags(model, last_microbatch, sync=sync, reshard=self.reshard_after_backward)

    @property
    def offload(self) -> bool:
        """FSDP2's CPUOffloadPolicy: it moves the sharded parameters and takes the optimizer along."""
        return self.options.offload_params

    @property
    def optimizer_host(self) -> torch.device | None:
        """Where the optimizer steps when only it is offloaded (on a CPU run the host copies sit in the same
        memory: nothing is saved, the path is the one a GPU run takes)."""
        return torch.device("cpu") if self.options.offload_optimizer and not self.options.offload_params else None

    def planner_fields(self) -> dict[str, Any]:
        """The sharding's fields of the planner's `Layout`."""
        return {"dp_flavour": self.dp_flavour, "reshard_after_forward": self.reshard_after_forward,
                "reshard_last_block": self.options.reshard_last_block,
                "prefetch_blocks": self.options.prefetch_blocks, "offload": self.offload,
                "grad_sync": self.options.grad_sync, "reshard_after_backward": self.reshard_after_backward,
                "offload_optimizer": self.optimizer_host is not None}

    def offload_policy(self, device: torch.device, is_global_zero: bool) -> OffloadPolicy:
        """FSDP2's offload policy on `device` (on the CPU there is nothing to offload: said once)."""
        if not self.offload:
            return OffloadPolicy()
        if device.type == "cpu":
            if not self._offload_noted and is_global_zero:
                log.warning("offload: the weights and optimizer states already live in CPU memory; "
                            "offloading changes nothing here and is skipped")
            self._offload_noted = True
            return OffloadPolicy()
        # FSDP2 offloads the sharded parameters, their gradients and the optimizer step together.
        return CPUOffloadPolicy(pin_memory=True)

    def wrap(self, model: nn.Module, mesh: DeviceMesh | None, edp_mesh: DeviceMesh | None, *,
             mp_policy: MixedPrecisionPolicy, device: torch.device, is_global_zero: bool) -> nn.Module:
        """`fully_shard` over `mesh` as the options say: the experts' own units over `edp_mesh` first (expert
        parallelism), then one unit per block and the root (`wrap_fsdp`)."""
        offload_policy = self.offload_policy(device, is_global_zero)
        shard_experts(model, edp_mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                      reshard_after_forward=self.reshard_after_forward)
        return wrap_fsdp(model, mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                         reshard_after_forward=self.reshard_after_forward,
                         prefetch_blocks=self.options.prefetch_blocks,
                         reshard_last_block=self.options.reshard_last_block)


class FSDP(DistributedStrategy):
    """FSDP2 over the data-parallel ranks; one `fully_shard` unit per transformer block plus the root.

    `sharding` picks the mode; every other option is a field of `FSDPOptions`, which Hydra hands over flat,
    as the config node holds them (it calls `_target_` with the node's keys). They make one `FSDPOptions`
    here, the only place they are unpacked, which the strategy keeps whole in `self.fsdp`."""

    name = "fsdp"
    supports_ep = True
    wraps_experts_apart = True  # shard_experts
    gathers_parameters = True  # type: ignore[assignment]

    def __init__(self, sharding: str = "full_shard", *, init: str = "auto", name: Optional[str] = None,
                 **options: Any) -> None:
        super().__init__(init=init, name=name)
        self.fsdp = FSDPSharding(sharding, FSDPOptions(**options))

    @property
    def optimizer_host(self) -> torch.device | None:
        return self.fsdp.optimizer_host

    def data_parallel_split(self, dp: int) -> tuple[int, int]:
        return self.fsdp.data_parallel_split(dp)

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        return {**super().planner_layout(dp, tp, pp, cp), **self.fsdp.planner_fields()}

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        return self.fsdp.wrap(model, self.dims.fsdp_mesh(), self.dims.edp_mesh(),
                              mp_policy=self.precision.fsdp_mixed_precision(), device=self.device,
                              is_global_zero=self.is_global_zero)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard changes the class in place, not the module tree

    def backward_sync(self, model: nn.Module, last_microbatch: bool) -> ContextManager[None]:
        return self.fsdp.backward_sync(model, last_microbatch)

    def reduce_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        super().reduce_gradients(model_parts)
        self.scale_expert_gradients(model_parts)

    @torch.no_grad()
    def evaluate(self, model_parts: Sequence[nn.Module], batches: Sequence[MicroBatch]) -> float:
        loss = super().evaluate(model_parts, batches)
        reshard_gathered(model_parts)
        return loss


def reshard_gathered(model_parts: Sequence[nn.Module]) -> None:
    """Free the parameters a forward without backward (validation) left gathered.

    The root unit and the last block (`reshard_last_block`) keep theirs after the forward because a
    training backward needs them next; after an evaluation none follows, and they would stay whole
    through the next step and any checkpoint, as plain tensors instead of DTensor shards."""
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def accumulation_flags(model: nn.Module, last_microbatch: bool, *, sync: bool, reshard: bool) -> Iterator[None]:
    """FSDP2's controls (also those of `replicate`) for one micro-batch: reduce its gradients (`sync`) and
    free the gathered parameters after its backward (`reshard`), both forced on the last micro-batch."""
    fsdp_model = cast(FSDPModule, model)
    fsdp_model.set_requires_gradient_sync(sync or last_microbatch)
    fsdp_model.set_reshard_after_backward(reshard or last_microbatch)
    fsdp_model.set_is_last_backward(last_microbatch)
    yield


def shard_experts(model: nn.Module, edp_mesh: DeviceMesh | None, *, mp_policy: MixedPrecisionPolicy,
                  offload_policy: OffloadPolicy, reshard_after_forward: bool) -> None:
    """Under expert parallelism (an edp mesh), every MoE layer's experts become their own FSDP unit over
    the ranks left (edp), before the blocks are wrapped, so the blocks' units skip them (their gradients'
    scale is fixed by `scale_expert_gradients`). Sharded on dim 1 (the SwiGLU width or the model width),
    not on the experts: a rank often holds fewer experts than there are edp ranks (Mixtral: 8 / ep 8 = 1
    over edp 8), and Shard(0) would leave all of them on one rank (torchtitan does the same)."""
    if edp_mesh is None:
        return
    for _, layer in family_of(model).expert_layers([model]):
        fully_shard(layer.experts, mesh=edp_mesh, mp_policy=mp_policy, offload_policy=offload_policy,
                    reshard_after_forward=reshard_after_forward, shard_placement_fn=lambda param: Shard(1))


def wrap_fsdp(model: nn.Module, mesh: DeviceMesh | None, *, mp_policy: MixedPrecisionPolicy,
              offload_policy: OffloadPolicy, reshard_after_forward: bool, prefetch_blocks: int,
              reshard_last_block: bool) -> nn.Module:
    """FSDP2 over `mesh` (1-D: shard; 2-D: replicate x shard): one unit per transformer block, then the
    root (embedding, final norm, head). Parameters that are already tensor-parallel DTensors become 2-D."""
    options = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    blocks = list(family_of(model).blocks(model).values())
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again right away by the backward: keep them (unless asked).
        reshard = reshard_after_forward and (reshard_last_block or index < len(blocks) - 1)
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
class FSDPConfig(FSDPOptions):
    """Schema of `strategy=fsdp` (and, named zero3, of `strategy=zero3`): the `FSDPOptions` fields, flat
    (`strategy.grad_sync=step`), and the strategy's own."""

    _target_: str = "trainer.plugins.strategies.FSDP"
    name: str = "fsdp"
    # full_shard (ZeRO-3), shard_grad_op (gradients and optimizer states sharded, parameters sharded at rest
    # and gathered once per micro-batch; textbook ZeRO-2 is strategy=zero2) or hybrid_shard (shard in
    # groups, replicate across).
    sharding: str = "full_shard"
    # Weight initialization: full (whole model on every rank, then sharded: bitwise the single-process
    # weights), sharded (each rank initializes its shards: for models too big for host memory) or auto.
    init: str = "auto"
