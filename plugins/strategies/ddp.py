"""Replicated data parallelism: DDP, and ZeRO-1 (DDP plus an optimizer sharded over the ranks)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from trainer.interfaces.precision import DTYPE_NAMES, Precision
from trainer.optim import optimizer_factory_from_config, optimizer_param_groups
from trainer.parallel_dims import shard_rows
from trainer.plugins.strategies.distributed import DistributedStrategy

COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")


def wrap_ddp(model: nn.Module, group: Any, device: torch.device, *, bucket_cap_mb: float = 25.0,
             gradient_as_bucket_view: bool = True, comm_hook: str = "none", powersgd_rank: int = 1,
             powersgd_start_iter: int = 2) -> DistributedDataParallel:
    """DistributedDataParallel over `group`, with an optional gradient-compression hook."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    if comm_hook == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif comm_hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start_iter)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp



def wraps_data_parallel(dp: int, tp: int, pp: int, cp: int) -> bool:
    """Whether DDP wraps the model: over the data-parallel ranks, and in a world of one process over a
    group of one (`ParallelDims.dp_mesh`), whose buckets hold the gradients as on N ranks."""
    return dp * cp > 1 or dp * tp * pp * cp == 1

class DDP(DistributedStrategy):
    """torch DistributedDataParallel: every rank holds the whole model; gradients are all-reduced.

    Gradients are synchronized only on the last micro-batch of an optimizer step (DDP's no_sync), so
    accumulation costs one all-reduce per step.
    """

    name = "ddp"
    supports_ep = True
    # Whether the optimizer states are partitioned (ZeRO-1), and so can be offloaded on their own.
    shards_optimizer_states = False

    def __init__(self, bucket_cap_mb: float = 25.0, comm_hook: str = "none", powersgd_rank: int = 1,
                 powersgd_start_iter: int = 2, gradient_as_bucket_view: bool = True, offload_params: bool = False,
                 offload_optimizer: bool = False, init: str = "auto", name: str | None = None) -> None:
        super().__init__(init=init, name=name)
        if offload_params:
            raise ValueError(
                f"strategy={self.name} cannot offload parameters: every rank keeps the whole model in device "
                "memory by design; parameters are offloaded by zero3 and fsdp (strategy.offload_params=true)")
        if offload_optimizer and not self.shards_optimizer_states:
            raise ValueError(
                f"strategy={self.name} cannot offload the optimizer: every rank holds all of its states; "
                "zero1, zero2, zero3 and fsdp offload their partition (strategy.offload_optimizer=true)")
        self.offload_optimizer = offload_optimizer
        if comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)}, got {comm_hook!r}")
        self.bucket_cap_mb = bucket_cap_mb
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_iter = powersgd_start_iter
        self.gradient_as_bucket_view = gradient_as_bucket_view

    def check_device(self, device_type: str) -> None:
        if self.comm_hook == "bf16" and device_type != "cuda":
            raise ValueError("comm_hook=bf16 needs CUDA with NCCL >= 2.10 (torch's bf16_compress_hook); "
                             "on CPU use comm_hook=fp16 or powersgd")

    def check_reduce_dtype(self, grad_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        # DistributedDataParallel all-reduces each gradient in the gradient's own dtype (only a comm hook
        # changes that): another reduce_dtype would be silently ignored.
        hooks = {torch.bfloat16: " (or strategy.comm_hook=bf16, CUDA only)", torch.float16: " (or strategy.comm_hook=fp16)"}
        raise ValueError(
            f"all-reduces the {DTYPE_NAMES[grad_dtype]} gradients in their own dtype and cannot honour it; set "
            f"precision.reduce_dtype={DTYPE_NAMES[grad_dtype]}{hooks.get(reduce_dtype, '')}, or pick strategy=zero2, "
            "zero3 or fsdp, whose FSDP2 mixed-precision policy reduces in the requested dtype")

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        flavour = "ddp" if wraps_data_parallel(dp, tp, pp, cp) else "none"
        return {**super().planner_layout(dp, tp, pp, cp), "dp_flavour": flavour,
                "comm_hook": self.comm_hook, "bucket_cap_mb": float(self.bucket_cap_mb)}

    def full_init(self, model: nn.Module) -> bool:
        return True  # every rank holds the full model anyway; DDP also broadcasts rank 0's weights

    def wrap_data_parallel(self, model: nn.Module) -> nn.Module:
        if self.dims.ep_enabled:  # split experts are reduced over their own ranks (reduce_expert_gradients)
            experts = {id(p) for p in self.expert_parameters([model])}
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, [name for name, p in model.named_parameters() if id(p) in experts])
        return wrap_ddp(model, self.dims.dp_cp_mesh().get_group(), self.device,  # type: ignore[union-attr]
                        bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=self.gradient_as_bucket_view,
                        comm_hook=self.comm_hook, powersgd_rank=self.powersgd_rank,
                        powersgd_start_iter=self.powersgd_start_iter)

    def backward_sync(self, model: nn.Module, last_microbatch: bool) -> ContextManager[None]:
        # all-reduce only once the last micro-batch's gradient has been accumulated
        return contextlib.nullcontext() if last_microbatch else model.no_sync()  # type: ignore[operator]

    def reduce_gradients(self, model_parts: Sequence[nn.Module]) -> None:
        self.reduce_expert_gradients(model_parts)  # DDP leaves the split experts alone


def _chunk_numel(param: torch.Tensor, world: int) -> int:
    """Elements of one rank's full-size Shard(0) chunk (ceil rows x row size)."""
    return -(-param.shape[0] // world) * (param.numel() // max(param.shape[0], 1))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (a tensor-parallel DTensor's local shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _write_chunks(data: torch.Tensor, chunks: torch.Tensor) -> None:
    """Write the ranks' Shard(0) chunks of `data` back into it: `chunks` row r is rank r's chunk padded to
    the full chunk size. The complete chunks go in one strided copy (no gathered intermediate)."""
    size = chunks.shape[1]
    if size == 0:
        return
    if not data.is_contiguous():
        data.copy_(chunks.reshape(-1)[:data.numel()].view_as(data))
        return
    flat = data.view(-1)
    complete = flat.numel() // size
    flat[:complete * size].view(complete, size).copy_(chunks[:complete])
    if flat.numel() > complete * size:
        flat[complete * size:].copy_(chunks[complete, :flat.numel() - complete * size])


def _divide_into_chunks(flat: torch.Tensor, divisor: int, chunks: torch.Tensor) -> None:
    """`flat` / `divisor` written into `chunks` (world x chunk size): row r gets rank r's Shard(0) chunk,
    the padding after the last rows is zeroed (the reverse of `_write_chunks`)."""
    size = chunks.shape[1]
    if size == 0:
        return
    complete = flat.numel() // size
    torch.div(flat[:complete * size].view(complete, size), divisor, out=chunks[:complete])
    if complete < chunks.shape[0]:
        tail = flat.numel() - complete * size
        torch.div(flat[complete * size:], divisor, out=chunks[complete, :tail])
        chunks[complete, tail:].zero_()
        chunks[complete + 1:].zero_()


class ShardedOptimizerStates:
    """ZeRO-1 optimizer states: partitioned evenly over the ranks of `mesh` (a strategy holds one).

    Each rank's optimizer steps a Shard(0) DTensor *view* of every parameter (its rows, in place), so
    optimizer states are split element-wise within padding, as in the ZeRO paper, whatever the
    parameter sizes (torch's ZeroRedundancyOptimizer assigns whole parameters to ranks, which leaves
    e.g. Llama-2-7B's optimizer states 5.6% uneven on 4 ranks). After the step one all-gather brings
    every rank the rows the others updated. Under tensor parallelism the rows are those of this rank's
    TP shard.
    """

    def __init__(self, mesh: DeviceMesh, device: torch.device, expert_mesh: DeviceMesh | None = None,
                 expert_params: Sequence[nn.Parameter] = (), bucket_cap_mb: float = 25.0) -> None:
        self._mesh = mesh
        self.device = device
        # The all-gather after the step (and ZeRO-2's reduce-scatter) moves buckets of at most this many
        # bytes (gathered size; a larger tensor is a bucket of its own), so the transient buffers stay
        # bounded whatever the model's size, as DeepSpeed's allgather_bucket_size does.
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self._shards: list[tuple[nn.Parameter, DTensor]] = []
        # Expert parallelism: the experts a rank holds are its ep rank's, so their states are partitioned
        # over the ranks holding the same experts (edp), not over all of dp x cp.
        self._expert_mesh = expert_mesh
        self._expert_ids = {id(p) for p in expert_params}
        # the all-gather plans, and the parameter storage they were built for (`_gather_updated_rows`)
        self._gather_plans: list[_GatherPlan] = []
        self._gather_key: tuple[int, ...] | None = None

    def mesh_of(self, param: nn.Parameter) -> DeviceMesh:
        """The ranks `param`'s rows are partitioned over."""
        if id(param) in self._expert_ids and self._expert_mesh is not None:
            return self._expert_mesh
        return self._mesh

    def _by_mesh(self) -> list[tuple[DeviceMesh, list[tuple[nn.Parameter, DTensor]]]]:
        groups: dict[int, tuple[DeviceMesh, list[tuple[nn.Parameter, DTensor]]]] = {}
        for param, view in self._shards:
            mesh = self.mesh_of(param)
            groups.setdefault(id(mesh), (mesh, []))[1].append((param, view))
        return list(groups.values())

    def build_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        factory, weight_decay = optimizer_factory_from_config(optimizer_cfg)
        groups = []
        for group in optimizer_param_groups(factory, model_parts, weight_decay):
            views = [self._sharded_view(p) for p in group["params"]]
            groups.append({**group, "params": views})
        return factory(groups)

    def optimizer_tensor_pairs(self) -> list[tuple[nn.Parameter, DTensor]]:
        """(parameter, the Shard(0) view of it the optimizer steps): checkpoints name each optimizer
        state after its parameter, so that it can be resharded onto another strategy."""
        return list(self._shards)

    def _as_shard(self, rows: torch.Tensor, like: torch.Tensor, mesh: DeviceMesh | None = None) -> DTensor:
        return DTensor.from_local(rows, mesh or self._mesh, [Shard(0)], run_check=False, shape=like.shape,
                                  stride=like.stride())

    def _sharded_view(self, param: nn.Parameter) -> DTensor:
        data = _local(param.data)
        mesh = self.mesh_of(param)
        view = self._as_shard(shard_rows(data, mesh.get_local_rank(), mesh.size()), data, mesh)
        self._shards.append((param, view))
        return view

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        """Attach each view's gradient rows, step through `precision` (which may skip), all-gather."""
        for param, view in self._shards:  # the all-reduced gradient's rows, as views (no copy)
            mesh = self.mesh_of(param)
            rank, world = mesh.get_local_rank(), mesh.size()
            grad = None if param.grad is None else _local(param.grad)
            view.grad = None if grad is None else self._as_shard(shard_rows(grad, rank, world), grad, mesh)
        stepped = precision.optimizer_step(optimizer)
        if stepped:
            self._gather_updated_rows()
        return stepped

    def _buckets(self, world: int, shards: Sequence[tuple[nn.Parameter, DTensor]]) -> list[list[tuple[nn.Parameter, DTensor]]]:
        """`shards` in order, cut into buckets of at most `bucket_bytes` across all ranks' chunks and of one
        dtype each."""
        buckets: list[list[tuple[nn.Parameter, DTensor]]] = [[]]
        size = 0
        dtype = None
        for param, view in shards:
            data = _local(param.data)
            nbytes = world * _chunk_numel(data, world) * data.element_size()
            if buckets[-1] and (size + nbytes > self.bucket_bytes or data.dtype != dtype):
                buckets.append([])
                size = 0
            buckets[-1].append((param, view))
            size += nbytes
            dtype = data.dtype
        return buckets

    @torch.no_grad()
    def _gather_updated_rows(self) -> None:
        """Bring every rank the rows the others updated: one in-place all-gather per bucket of parameters.

        Each rank contributes its chunk of every parameter padded to the full chunk size, so all ranks
        send buffers of one length; ranks' chunks of a parameter are contiguous rows, so writing the other
        ranks' chunks back in rank order (dropping the tail padding) gives the whole parameter. The plans
        (the views copied from and to) are built once and reused while the parameters keep their storage,
        so that a step costs a few calls per bucket rather than per tensor.
        """
        key = tuple(_local(param.data).data_ptr() for param, _ in self._shards)
        if self._gather_key != key:
            self._gather_plans = [_GatherPlan(mesh, bucket, self.device)
                                  for mesh, shards in self._by_mesh()  # per partition group (two under ep)
                                  for bucket in self._buckets(mesh.size(), shards)]
            self._gather_key = key
        for plan in self._gather_plans:
            plan.run()


class _GatherPlan:
    """The all-gather of one bucket of updated rows with what does not change between steps prepared: the
    views of this rank's updated rows, of the places in the parameters the other ranks' rows go to, and
    their offsets in the gathered buffer (rank r's row: its chunks of the bucket's parameters, each padded
    to the full chunk size). The buffer itself is allocated per step, so that at most one bucket of it
    exists at a time."""

    def __init__(self, mesh: DeviceMesh, bucket: Sequence[tuple[nn.Parameter, DTensor]], device: torch.device) -> None:
        self.group = mesh.get_group()
        self.world, self.rank = world, rank = mesh.size(), mesh.get_local_rank()
        datas = [_local(param.data) for param, _ in bucket]
        sizes = [_chunk_numel(data, world) for data in datas]
        self.numel, self.dtype, self.device = sum(sizes), datas[0].dtype, device
        self.sources: list[torch.Tensor] = []  # this rank's updated rows ...
        self.slots: list[tuple[int, torch.Size]] = []  # ... and their offsets and shapes in its row of the buffer
        self.targets: list[torch.Tensor] = []  # the other ranks' rows in the parameters ...
        self.chunks: list[tuple[int, int, int]] = []  # ... from (rank, offset, elements) of the buffer
        self.fallback: list[tuple[torch.Tensor, int, int]] = []  # non-contiguous parameters: whole rewrite
        offset = 0
        for (_, view), data, size in zip(bucket, datas, sizes):
            rows = view.to_local()  # what the optimizer updated: a view of this rank's rows of the parameter
            self.sources.append(rows)
            self.slots.append((offset, rows.shape))  # the padding after it is never read
            if data.is_contiguous():
                flat = data.view(-1)
                # own rows were updated in place, unless the view no longer shares the parameter's storage
                in_place = rows.numel() == 0 or rows.data_ptr() == flat[rank * size:].data_ptr()
                for other in range(world):
                    start, end = other * size, min((other + 1) * size, flat.numel())
                    if (other != rank or not in_place) and end > start:
                        self.targets.append(flat[start:end])
                        self.chunks.append((other, offset, end - start))
            else:
                self.fallback.append((data, offset, size))
            offset += size
        self.needed = world > 1 or bool(self.targets) or bool(self.fallback)

    def run(self) -> None:
        if not self.needed:
            return  # one rank whose views are its parameters: already updated
        gathered = torch.empty(self.world, self.numel, dtype=self.dtype, device=self.device)
        mine = gathered[self.rank]
        torch._foreach_copy_([mine[offset:offset + shape.numel()].view(shape) for offset, shape in self.slots],
                             self.sources)
        if self.world > 1:  # in place: this rank's input is its row of the output, as FSDP2 gathers
            dist.all_gather_into_tensor(gathered.view(-1), mine, group=self.group)
        if self.targets:
            torch._foreach_copy_(self.targets, [gathered[r, offset:offset + n] for r, offset, n in self.chunks])
        for data, offset, size in self.fallback:
            _write_chunks(data, gathered[:, offset:offset + size])


class ShardedGradients(ShardedOptimizerStates):
    """ZeRO-2 on top of ZeRO-1's partition: gradients too are held only for this rank's rows.

    The backward accumulates plain local gradients over the micro-batches (no communication); once per
    optimizer step `reduce_scatter_gradients` averages them over the ranks with reduce-scatters into
    each rank's rows (in buckets of at most `bucket_cap_mb`, in `reduce_dtype` when given) and frees
    the full gradients, so that between steps a rank holds its partition of the gradients and of the
    optimizer states, and the whole parameters (Rajbhandari et al. 2020, stage 2). The step and the
    all-gather of the updated rows are ZeRO-1's.
    """

    def __init__(self, mesh: DeviceMesh, device: torch.device, bucket_cap_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None, expert_mesh: DeviceMesh | None = None,
                 expert_params: Sequence[nn.Parameter] = ()) -> None:
        super().__init__(mesh, device, expert_mesh, expert_params, bucket_cap_mb)
        self.reduce_dtype = reduce_dtype

    def views(self) -> list[DTensor]:
        """The tensors holding this rank's gradient rows (what norms and unscaling look at)."""
        return [view for _, view in self._shards]

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """Average the accumulated gradients over the ranks into each rank's rows; free the full ones."""
        # The mean over all dp x cp ranks: an expert's gradient (under ep) already sums its ep group's
        # tokens, so its edp reduce-scatter is divided by dp x cp too, not by the edp size.
        ranks = self._mesh.size()
        for mesh, shards in self._by_mesh():
            self._reduce_scatter(mesh, shards, ranks)

    def _reduce_scatter(self, mesh: DeviceMesh, shards: Sequence[tuple[nn.Parameter, DTensor]], ranks: int) -> None:
        rank, world = mesh.get_local_rank(), mesh.size()
        group = mesh.get_group()
        for bucket in self._buckets(world, shards):
            datas = [_local(param.data) for param, _ in bucket]
            sizes = [_chunk_numel(data, world) for data in datas]
            dtype = self.reduce_dtype or datas[0].dtype
            # row r of `send` holds every parameter's r-th chunk (its rows under Shard(0)), written divided by
            # the ranks (the mean, as DDP divides before its all-reduce) in one pass per parameter
            send = torch.empty(world, sum(sizes), dtype=dtype, device=self.device)
            offset = 0
            for (param, _), size in zip(bucket, sizes):
                segment = send[:, offset:offset + size]
                if param.grad is None:
                    segment.zero_()
                else:
                    _divide_into_chunks(_local(param.grad).reshape(-1), ranks, segment)
                offset += size
            if world > 1:
                received = torch.empty(sum(sizes), dtype=dtype, device=self.device)
                dist.reduce_scatter_tensor(received, send.view(-1), op=dist.ReduceOp.SUM, group=group)
            else:
                received = send[0]
            offset = 0
            for (param, view), data, size in zip(bucket, datas, sizes):
                rows = shard_rows(data, rank, world)
                grad = received[offset:offset + rows.numel()].view(rows.shape).to(data.dtype)
                view.grad = self._as_shard(grad, data, mesh)  # views of `received`: exactly this rank's rows
                param.grad = None
                offset += size

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        """The gradient rows are already attached (`reduce_scatter_gradients`): step, then all-gather."""
        stepped = precision.optimizer_step(optimizer)
        if stepped:
            self._gather_updated_rows()
        return stepped


class ZeRO1(DDP):
    """ZeRO stage 1: DDP for gradients, optimizer states partitioned over the data-parallel ranks."""

    name = "zero1"

    def __init__(self, **ddp_options: Any) -> None:
        super().__init__(**ddp_options)
        self.sharded_states: ShardedOptimizerStates | None = None

    shards_optimizer_states = True

    @property
    def optimizer_host(self) -> torch.device | None:
        # ZeRO-Offload: this rank's partition of the optimizer states (and fp32 masters) in host memory,
        # stepped there; on a CPU run the copies sit in the same memory (nothing saved, the GPU path)
        return torch.device("cpu") if self.offload_optimizer else None

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        flavour = "zero1" if wraps_data_parallel(dp, tp, pp, cp) else "none"
        return {**super().planner_layout(dp, tp, pp, cp), "dp_flavour": flavour,
                "offload_optimizer": self.offload_optimizer}

    def make_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        self.sharded_states = ShardedOptimizerStates(self.dims.dp_cp_mesh(), self.device,  # type: ignore[arg-type]
                                                     self.dims.edp_mesh(), self.expert_parameters(model_parts),
                                                     bucket_cap_mb=self.bucket_cap_mb)
        return self.sharded_states.build_optimizer(optimizer_cfg, model_parts)

    def optimizer_tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.sharded_states.optimizer_tensor_pairs() if self.sharded_states is not None else []

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        assert self.sharded_states is not None, "build_optimizer() first"
        return self.sharded_states.optimizer_step(optimizer, self.precision)


@dataclass
class DDPConfig:
    """Schema of `strategy=ddp`."""

    _target_: str = "trainer.plugins.strategies.DDP"
    name: str = "ddp"
    # Gradient bucket size: larger buckets mean fewer, bigger all-reduces.
    bucket_cap_mb: float = 25.0
    # Gradient compression: none, bf16, fp16 (cast before the all-reduce) or powersgd (low rank).
    comm_hook: str = "none"
    # PowerSGD: rank of the approximation and the step it starts at (plain all-reduce before).
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    # Let gradients alias the communication buckets (saves one gradient-sized copy).
    gradient_as_bucket_view: bool = True
    # ddp keeps the whole model and optimizer on every rank: it refuses both (listed so that asking gets an
    # explanation rather than an unknown-key error); zero1 takes offload_optimizer (ZeRO-Offload: its
    # partition of the optimizer states in host memory, stepped there).
    offload_params: bool = False
    offload_optimizer: bool = False


@dataclass
class ZeRO1Config(DDPConfig):
    """Schema of `strategy=zero1`."""

    _target_: str = "trainer.plugins.strategies.ZeRO1"
    name: str = "zero1"
