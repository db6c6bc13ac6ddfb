"""Shared base of the multi-process strategies: process group, mesh, collectives, weight materialization."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.interfaces.strategy import MicroBatch, Strategy, compile_blocks
from trainer.models.context_parallel import ContextParallel, enable_context_parallel
from trainer.models import family_of
from trainer.models.moe import ExpertParallel
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


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True when `flag` holds on every rank of the default process group (one all-reduce), for a choice every
    rank must make alike; `flag` itself when there is no process group (one process)."""
    if not dist.is_initialized():
        return flag
    tensor = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return bool(tensor.item())


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


def clip_mixed_grad_norm(model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
    """Global gradient norm (and clipping) over gradients laid out on different meshes: expert weights on
    the expert mesh, the others plain or on the world mesh. torch's own stacks the per-tensor norms, which
    DTensors of different meshes refuse; `local_grad_norm` reduces each layout's norm over its own mesh."""
    params = {id(p): p for part in model_parts for p in part.parameters() if p.grad is not None}
    total = local_grad_norm([p.grad for p in params.values()])  # type: ignore[misc]
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0:
            with torch.no_grad():
                for p in params.values():
                    p.grad.mul_(coef)  # type: ignore[union-attr]
    return total


def local_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of `grads` (plain tensors and DTensors, possibly on different meshes), as a plain tensor.

    DTensors are grouped by mesh and placements (torch's foreach norm needs one layout per call); the
    norm of a sharded group is a Partial DTensor whose `full_tensor()` sums over that mesh, and that of
    a replicated one is already complete.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else ("plain", grad.device)
        groups.setdefault(key, []).append(grad)
    squares: list[torch.Tensor] = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    if not squares:
        device = grads[0].device if grads else torch.device("cpu")
        return torch.zeros((), device=device)
    device = squares[0].device
    return torch.stack([s.to(device) for s in squares]).sum().sqrt()


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
                          pp: int = 1, cp: int = 1, cp_method: str = "ring", ep: int = 1, *,
                          adopt_process_group: bool = False) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        super().setup_environment(accelerator, num_threads or max(1, (os.cpu_count() or 1) // local_world))
        made = init_process_group(self.device, self.collective_timeout_s)
        self._owns_process_group = made or adopt_process_group
        if not self.uses_dp:
            data_parallel = 1
        else:
            data_parallel = self.world_size // (tp * pp * cp) if dp == "auto" else int(dp)
        replicate, shard = self.data_parallel_split(data_parallel)
        self.parallel_dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp,
                                          world_size=self.world_size, ep=ep)
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
        # The precision plugin first swaps modules for its number format's (fp8: float8 linear layers, on
        # the meta device, so every later step sees the final module types). Pipeline parallelism then
        # cuts the model into this rank's stages; every part goes through the same fixed order:
        # 1. tensor parallel (the model-parallel strategies shard Linear weights here),
        # 1b. expert parallel (each MoE layer keeps its ep rank's experts, as DTensor shards; no other weight
        #    changes),
        # 2. context parallel (attention across the cp ring; no weights change, so after TP it sees the
        #    local heads, and before AC so a recompute runs the same distributed attention),
        # 3. activation checkpointing (wraps whole blocks, after TP so it sees the sharded modules),
        # 4. compile per block (after AC, so the recompute region is inside the compiled graph),
        # 5. data-parallel wrapping last: DDP/FSDP need the final module structure.
        # Weights are initialized in full before wrapping when they fit (`init=full`), which gives
        # bitwise the same initial weights as a single-process run; big models are initialized shard by
        # shard after wrapping (`init=sharded`).
        self.precision.setup(self.device)
        self.precision.convert_model(model, self.gathers_parameters)
        self.compiled_loss = compile
        full = self.full_init(model)
        if full:  # before the split and TP, so every shard and stage holds the single-process weights
            self.materialize(model)
        # Drawn in fp32 then cast (the same weights as one process), or cast on the meta device so that
        # a sharded init allocates its shards in the parameter dtype (bf16_true) before FSDP records it.
        model.to(dtype=self.precision.param_dtype)
        parts = []
        for part in self.split_pipeline(model):
            self.apply_model_parallel(part)
            self.apply_expert_parallel(part)
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

    def apply_expert_parallel(self, model: nn.Module) -> None:
        """Expert parallelism (ep > 1): every MoE layer keeps n_experts / ep experts, its ep rank's, as
        `Shard(0)` DTensors over the ep mesh (checkpoints then hold the whole expert tensors, so they
        reshard onto any ep), and exchanges tokens with its ep group. Cutting the full weights needs no
        communication (`src_data_rank=None`): every rank holds the same ones."""
        mesh = self.dims.ep_mesh()
        if mesh is None:
            return
        group = ExpertParallel(mesh.get_group(), mesh.get_local_rank(), mesh.size())
        for _, module in family_of(model).expert_layers([model]):
            module.expert_parallel = group
            experts = module.experts
            for name, param in list(experts.named_parameters(recurse=False)):
                # under tp the experts are Replicate DTensors on the tp mesh by now: every tp rank computes
                # them on the same (gathered) tokens, so they stay whole there and are cut over ep only
                sharded = distribute_tensor(_local(param.data), mesh, [Shard(0)], src_data_rank=None)
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def expert_parameters(self, model_parts: Sequence[nn.Module]) -> list[nn.Parameter]:
        """The routed experts' weights (split over the ep ranks) of the model parts."""
        return [p for _, layer in family_of(model_parts[0]).expert_layers(model_parts) for p in layer.experts.parameters()]

    def reduce_expert_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        """Expert gradients under a replicating wrapper (DDP leaves them alone): each rank's already holds
        the sum over its ep group's tokens (the all-to-all's backward brought them), so a SUM over the
        ranks holding the same experts (edp) divided by dp x cp gives the data-parallel mean."""
        if not self.dims.ep_enabled:
            return
        grads = [_local(p.grad) for p in self.expert_parameters(model_parts) if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        edp = self.dims.edp_mesh()
        if edp is not None and edp.size() > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=edp.get_group())
        flat /= self.dims.dp * self.dims.cp
        offset = 0
        with torch.no_grad():
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def scale_expert_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        """Expert gradients a data-parallel wrapper averaged over the edp ranks holding the same experts
        (their own FSDP or replicate units): each already sums its ep group's tokens, so 1/ep more makes it
        the mean over all dp x cp ranks. (FSDP's `set_gradient_divide_factor` would do it inside the
        reduce-scatter, but its PREMUL_SUM is not in gloo.)"""
        if not self.dims.ep_enabled:
            return
        with torch.no_grad():
            for param in self.expert_parameters(model_parts):
                if param.grad is not None:
                    param.grad.mul_(1.0 / self.dims.ep)

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
        for _, layer in family_of(model).expert_layers([model]):  # its balancing statistics span whole sequences
            layer.sequence_group = self.context_parallel.group

    def local_batches(self, microbatches: Sequence[MicroBatch]) -> Sequence[MicroBatch]:
        # document ids from the whole sequence, before context parallelism keeps this rank's tokens
        microbatches = super().local_batches(microbatches)
        if self.context_parallel is None:
            return microbatches
        shard = self.context_parallel.shard
        return [(shard(inputs), shard(targets), *doc_ids) for inputs, targets, *doc_ids in microbatches]

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

    def replica_mesh(self, tensor: torch.Tensor) -> DeviceMesh | None:
        """A plain tensor the optimizer steps is replicated over the ranks that average gradients (dp x cp:
        DDP's parameters; the sharding strategies hand the optimizer DTensors, whose placements say it all).
        Under expert parallelism an expert tensor split over the ep ranks alone (Shard(0): whole experts on
        each) is replicated over the ranks holding the same experts (edp)."""
        if isinstance(tensor, DTensor):
            if self.dims.ep_enabled and tensor.device_mesh == self.dims.ep_mesh():
                return self.dims.edp_mesh()
            return None
        return self.dims.dp_cp_mesh()

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

    def reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Maximum over the data- and context-parallel ranks."""
        mesh = self.dims.dp_cp_mesh()
        if mesh is None:
            return tensor
        tensor = tensor.detach().clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return tensor

    def reduce_over_model_parallel(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Over the pp ranks, then the tp ranks (a sum or max over both: every pair of coordinates once)."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"op must be one of {', '.join(ops)}, got {op!r}")
        tensor = tensor.detach().clone()
        for name in ("pp", "tp"):
            if name in (self.dims.mesh.mesh_dim_names or ()):
                dist.all_reduce(tensor, op=ops[op], group=self.dims.mesh[name].get_group())
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def clip_grad_norm(self, model_parts: Any, max_norm: float) -> torch.Tensor:
        if self.parallel_dims is not None and self.dims.ep_enabled:
            return clip_mixed_grad_norm(model_parts, max_norm)
        norm = super().clip_grad_norm(model_parts, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def barrier(self) -> None:
        dist.barrier()

    def teardown(self) -> None:
        """Destroy the process group. Call it after dropping the model parts (see `run.train`)."""
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
