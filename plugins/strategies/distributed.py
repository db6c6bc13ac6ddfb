"""Shared base of the multi-process strategies: process group, mesh, collectives, weight materialization."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.interfaces.strategy import MicroBatch, Strategy, compile_blocks
from trainer.models.context_parallel import ContextParallel, enable_context_parallel
from trainer.parallel_dims import ParallelDims

log = logging.getLogger("trainer")
# Above this many bytes of fp32 weights, `init=auto` initializes shards in place instead of building the
# full model on every rank first.
FULL_INIT_MAX_BYTES = 4 * 2**30


def init_process_group(device: torch.device, timeout_s: float = 600.0) -> bool:
    """nccl for CUDA tensors (gloo kept for CPU objects and offloaded states), gloo on CPU.

    Without a launcher's RANK (`trainer.devices=1`: the CLI starts no workers) this process is the whole
    world: its group of one gets an in-process store, since env:// rendezvous needs RANK/MASTER_ADDR.
    Returns False when a process group already exists (a program embedding the trainer made it, and
    will destroy it).
    """
    if dist.is_initialized():
        return False
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return True


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def average_in_buckets(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Replace each tensor by its mean over `group`, with one all-reduce per dtype and device."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    size = dist.get_world_size(group)
    for members in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= size
        offset = 0
        with torch.no_grad():
            for tensor in members:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


class DistributedStrategy(Strategy):
    """A strategy over several processes started by the launcher, torchrun or srun."""

    uses_dp = True
    uses_cp = True

    def __init__(self, init: str = "auto", name: str | None = None) -> None:
        super().__init__()
        if init not in ("auto", "full", "sharded"):
            raise ValueError(f"init must be auto, full or sharded, got {init!r}")
        self.init = init
        self.name = name or self.name  # zero2/zero3 are fsdp configurations with their own name
        self._owns_process_group = False
        # This rank's context-parallel group and method (None with cp=1), made by `setup_environment`.
        self.context_parallel: ContextParallel | None = None

    # ---- topology -----------------------------------------------------------------------------------
    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        replicate, shard = self.data_parallel_split(dp) if self.uses_dp else (1, 1)
        return {**super().planner_layout(dp, tp, pp, cp), "dp_replicate": replicate, "dp_shard": shard}

    def setup_environment(self, accelerator: str, num_threads: int | None, dp: int | str = 1, tp: int = 1,
                          pp: int = 1, cp: int = 1, cp_method: str = "ring") -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        super().setup_environment(accelerator, num_threads or max(1, (os.cpu_count() or 1) // local_world))
        self._owns_process_group = init_process_group(self.device, self.collective_timeout_s)
        if not self.uses_dp:
            data_parallel = 1
        else:
            data_parallel = self.world_size // (tp * pp * cp) if dp == "auto" else int(dp)
        replicate, shard = self.data_parallel_split(data_parallel)
        self.parallel_dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp,
                                          world_size=self.world_size)
        self.parallel_dims.build_mesh(self.device.type)
        cp_mesh = self.parallel_dims.cp_mesh()
        if cp_mesh is not None:
            self.context_parallel = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp, cp_method)

    @property
    def dims(self) -> ParallelDims:
        assert self.parallel_dims is not None, "setup_environment() first"
        return self.parallel_dims

    @property
    def dp_rank(self) -> int:
        mesh = self.dims.dp_mesh()
        return mesh.get_local_rank() if mesh is not None else 0

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    # ---- model --------------------------------------------------------------------------------------
    def full_init(self, model: nn.Module) -> bool:
        if self.init != "auto":
            return self.init == "full"
        return sum(p.numel() for p in model.parameters()) * 4 <= FULL_INIT_MAX_BYTES

    def materialize(self, model: nn.Module) -> None:
        """Allocate the (possibly sharded) weights on the device and initialize them from the seed."""
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()  # type: ignore[operator]

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        """Apply the data-parallel wrapper (DDP, fully_shard...). Identity by default."""
        return model

    def setup_model(self, model: nn.Module, activation_checkpointing: ActivationCheckpointing,
                    compile: bool) -> list[nn.Module]:
        # Pipeline parallelism first cuts the (meta) model into this rank's stages; every part then goes
        # through the same fixed order:
        # 1. tensor parallel (the model-parallel strategies shard Linear weights here),
        # 2. context parallel (attention across the cp ring; no weights change, so after TP it sees the
        #    local heads, and before AC so a recompute runs the same distributed attention),
        # 3. activation checkpointing (wraps whole blocks, after TP so it sees the sharded modules),
        # 4. compile per block (after AC, so the recompute region is inside the compiled graph),
        # 5. data-parallel wrapping last: DDP/FSDP need the final module structure.
        # Weights are initialized in full before wrapping when they fit (`init=full`), which gives
        # bitwise the same initial weights as a single-process run; big models are initialized shard by
        # shard after wrapping (`init=sharded`).
        self.precision.setup(self.device)
        full = self.full_init(model)
        if full:  # before the split and TP, so every shard and stage holds the single-process weights
            self.materialize(model)
        # Drawn in fp32 then cast (the same weights as one process), or cast on the meta device so that
        # a sharded init allocates its shards in the parameter dtype (bf16_true) before FSDP records it.
        model.to(dtype=self.precision.param_dtype)
        parts = []
        for part in self.split_pipeline(model):
            self.apply_model_parallel(part)
            self.apply_context_parallel(part)
            activation_checkpointing.apply(part)
            if compile:
                compile_blocks(part)
            wrapped = self.wrap_data_parallel(part)
            if not full:
                self.materialize(wrapped)
            parts.append(wrapped)
        return parts

    def split_pipeline(self, model: nn.Module) -> list[nn.Module]:
        """This rank's pipeline stages (one part, the whole model, without pipeline parallelism)."""
        return [model]

    def apply_model_parallel(self, model: nn.Module) -> None:
        """Tensor parallelism hook (the model-parallel strategies override it)."""

    def apply_context_parallel(self, model: nn.Module) -> None:
        """Context parallelism: the model's attention works across the cp ring and its positions are
        this rank's global ones. Every dropout then sees only this rank's tokens, so each cp rank draws
        from its own random streams (stream k of tensor parallelism becomes k + (tp + 1) x cp_rank: the
        replicated stream 0 stays shared by the tp ranks of one cp rank)."""
        if self.context_parallel is None:
            return
        enable_context_parallel(model, self.context_parallel)
        offset = (self.dims.tp + 1) * self.context_parallel.rank
        for module in model.modules():
            if hasattr(module, "rng_stream"):
                module.rng_stream += offset

    def local_batches(self, microbatches: Sequence[MicroBatch]) -> Sequence[MicroBatch]:
        if self.context_parallel is None:
            return microbatches
        shard = self.context_parallel.shard
        return [(shard(inputs), shard(targets)) for inputs, targets in microbatches]

    def forward_backward(self, model_parts: Sequence[nn.Module], microbatches: Sequence[MicroBatch],
                         on_before_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        loss = super().forward_backward(model_parts, microbatches, on_before_backward)
        self.reduce_gradients(model_parts)
        return loss

    def reduce_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        """Strategies without a data-parallel wrapper (tp, pp) average the gradients over the cp ranks
        here (one all-reduce per dtype); the wrappers of the others reduce over dp x cp themselves."""
        if self.uses_dp or self.context_parallel is None:
            return
        grads = [_local(p.grad) for part in model_parts for p in part.parameters() if p.grad is not None]
        average_in_buckets(grads, self.context_parallel.group)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return getattr(module, "module", module)  # DistributedDataParallel keeps the model as `.module`

    # ---- collectives ----------------------------------------------------------------------------------
    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over the data- and context-parallel ranks (gloo has no AVG, so SUM then divide)."""
        mesh = self.dims.dp_cp_mesh()
        if mesh is None:
            return tensor
        tensor = tensor.detach().clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return tensor / mesh.size()

    def broadcast_object(self, obj: Any) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def clip_grad_norm(self, model_parts: Any, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm(model_parts, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def barrier(self) -> None:
        dist.barrier()

    def teardown(self) -> None:
        """Destroy the process group. Call it after dropping the model parts (see `run.train`)."""
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
