"""`optimizer=muon`: Muon for the hidden weight matrices, AdamW for everything else, in one optimizer.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) replaces each hidden matrix's update by the
orthogonalised Nesterov momentum: ``O = NS5(g + mu * m)`` with ``m = mu * m + g``, where NS5 is five steps
of the quintic Newton-Schulz iteration with the published coefficients (3.4445, -4.7750, 2.0315), run in
bf16 by default (``ns_dtype``). The update is scaled by ``rms_scale * sqrt(max(rows, cols))`` so that its
RMS matches a typical AdamW update (Moonlight's 0.2), and weight decay is decoupled:
``W <- W * (1 - lr * wd) - lr * scale * O``. The other parameters (embeddings, the output layer, norms and
biases) are stepped by AdamW with their own learning rate (``adamw_lr``); which parameter is which is
decided by ``trainer.optim.param_groups`` (the groups it makes carry ``use_muon``), not here.

Distribution. Newton-Schulz needs each matrix whole, but the optimizer may step a shard of it (ZeRO's row
views, FSDP2 and tensor-parallel DTensors) or one of several identical copies (DDP). Each matrix is
orthogonalised exactly once per step, by one owner rank:

1. the momentum is updated on the local shard (element-wise, no communication);
2. each matrix gets one owner, round-robin over the ranks that hold pieces or copies of it (the mesh
   dimensions of its DTensor layout that split a matrix dimension or replicate it, and the copies a
   strategy keeps outside any DTensor layout: DDP's data-parallel ranks, `Strategy.replica_mesh`), so the
   work is spread over the data-parallel ranks. A mesh dimension that splits a batch of matrices (the
   experts of a MoE layer) is no owner group: each rank's matrices are whole already;
3. one mesh dimension (ZeRO's row views, FSDP2 and tp on their own, DDP's replicas): every rank sends its
   piece of each matrix to the matrix's owner and the owner sends each rank its piece of the result, two
   ``all_to_all_single`` per owner group and step for all the matrices together (a replicated matrix
   sends nothing there: its owner holds it whole, and gets the whole result back);
4. several mesh dimensions (hybrid sharding, FSDP2 x tp with its strided shards, experts under FSDP2):
   ``DTensor.redistribute`` to ``Replicate`` on the dimensions that split a matrix (all-gathers), the
   owner runs Newton-Schulz while every other rank contributes zeros, and one ``redistribute`` from
   ``Partial`` back to the matrix's own placements (a reduce-scatter, or an all-reduce for replicated
   dimensions) hands every rank its part: exact, since x + 0 = x.

Under tensor parallelism the matrices are gathered over the tp group (the math does not allow
orthogonalising per shard: NS of a column block is not a block of NS).

Expert weights (3-D, ``experts x rows x cols``) are orthogonalised per expert, as a batch of matrices.
Untested: an optimizer offloaded to host memory on a GPU (`offload_optimizer`), whose exchange would hand
NCCL host tensors; on CPU (gloo) it is the same path.

QK-clip (MuonClip, Kimi K2 2025): ``qk_clip_tau`` (``optimizer.qk_clip_tau=100``; None, the default, is off)
caps each attention head's largest pre-softmax logit. It is not done in `step`, which never sees the
logits: the attention records each head's maximum over the step's batch, and after the step
`trainer.models.qk_clip.QKClip` reduces the maxima with MAX over the data- and context-parallel ranks and
scales every head above tau by gamma = tau / max (sqrt(gamma) on its wq and wk rows; gamma on wq alone
when query heads share a key head), under every strategy (see that module). Llama-family models only:
validation refuses Qwen3 (QK-norm), DeepSeek-V3 (MLA, not implemented) and GPT (fused wqkv, not
implemented), and fp32 master weights or an offloaded optimizer (their copies would undo the scaling).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

__all__ = ["Muon", "MuonConfig", "newton_schulz", "NS_COEFFICIENTS"]

# The quintic iteration's coefficients (Keller Jordan's Muon, also Moonlight's and torchtitan's).
NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# What resolves the ranks that hold identical copies of a stepped tensor outside its DTensor layout.
ReplicaMesh = Callable[[torch.Tensor], "DeviceMesh | None"]


def newton_schulz(matrices: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalisation of each matrix in the last two dimensions of `matrices` (leading dimensions are
    a batch): `steps` quintic Newton-Schulz iterations in `dtype`, returned in `dtype`.

    The iteration works on the wide orientation (rows <= cols), where X @ X^T is the smaller product, after
    scaling each matrix to a spectral norm of at most 1 (its Frobenius norm bounds the spectral one)."""
    a, b, c = NS_COEFFICIENTS
    x = matrices.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _split_dim(placement: Placement) -> int | None:
    """The tensor dimension a placement splits (Shard and FSDP2's strided shard under tp), else None."""
    if isinstance(placement, Shard):
        return placement.dim
    dim = getattr(placement, "dim", None)  # _StridedShard (not a Shard subclass in torch 2.13)
    return dim if isinstance(dim, int) else None


@dataclass
class _Layout:
    """How the matrices of one stepped tensor are spread: the mesh and placements its local values have,
    what they become once the matrices are whole, and the mesh dimensions whose ranks then hold the same
    whole matrices (the owner group)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    gathered: tuple[Placement, ...]
    group_dims: tuple[int, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return math.prod(self.mesh.size(d) for d in self.group_dims)

    def my_index(self) -> int:
        """This rank's position in its owner group (row-major over `group_dims`)."""
        coordinate = self.mesh.get_coordinate()
        assert coordinate is not None
        index = 0
        for d in self.group_dims:
            index = index * self.mesh.size(d) + coordinate[d]
        return index


def _layout_of(tensor: torch.Tensor, replicas: DeviceMesh | None) -> _Layout | None:
    """The layout of `tensor`'s matrices, or None when this rank alone holds them whole."""
    local = _local(tensor)
    if replicas is not None and replicas.size() > 1:
        # identical copies of whole matrices (DDP's parameters, experts replicated over edp)
        placements = tuple(Replicate() for _ in range(replicas.ndim))
        return _Layout(replicas, placements, placements, tuple(range(replicas.ndim)), local.shape, local.stride())
    if not isinstance(tensor, DTensor):
        return None
    matrix_dims = {tensor.ndim - 2, tensor.ndim - 1}
    gathered: list[Placement] = []
    group: list[int] = []
    for index, placement in enumerate(tensor.placements):
        dim = _split_dim(placement)
        if dim is not None and dim < 0:
            dim += tensor.ndim
        if dim is not None and dim not in matrix_dims:
            gathered.append(placement)  # splits a batch of matrices (experts): each rank's are whole
            continue
        gathered.append(Replicate())
        group.append(index)  # a split matrix dimension, or replicated ranks: one owner among them
    layout = _Layout(tensor.device_mesh, tuple(tensor.placements), tuple(gathered), tuple(group),
                     tensor.shape, tensor.stride())
    return layout if layout.group_size > 1 else None


@dataclass
class _Work:
    """One tensor to orthogonalise this step: its parameter (or stand-in), group, local update, layout, and
    once computed this rank's part of the result."""

    param: torch.Tensor
    group: dict[str, Any]
    update: torch.Tensor
    layout: _Layout | None
    result: torch.Tensor | None = None


def _matrix_split(layout: _Layout) -> int | None:
    """The tensor dimension a 1-D layout splits (None: replicated)."""
    placement = layout.placements[0]
    return placement.dim % len(layout.shape) if isinstance(placement, Shard) else None


def _exchangeable(layout: _Layout, update: torch.Tensor) -> bool:
    """Whether the all-to-all exchange handles the layout: one mesh dimension, a plain Shard of a matrix
    dimension (ceil-sized chunks, as `Muon._exchange` cuts them) or Replicate; else the DTensor path."""
    if layout.mesh.ndim != 1 or layout.group_dims != (0,):
        return False
    placement = layout.placements[0]
    if isinstance(placement, Replicate):
        return update.shape == layout.shape
    if type(placement) is not Shard:
        return False
    dim = placement.dim % len(layout.shape)
    size, world = layout.shape[dim], layout.mesh.size()
    chunk = -(-size // world)
    start = min(layout.mesh.get_local_rank() * chunk, size)
    return update.shape[dim] == min(start + chunk, size) - start


class Muon(torch.optim.Optimizer):
    """Muon for the parameter groups with ``use_muon=True`` (matrices, or batches of them in the last two
    dimensions), AdamW for the others; see the module docstring for the update and its distribution.

    Args:
        params: parameter groups (``trainer.optim.param_groups(..., hidden_matrices=True)`` makes them).
        lr: learning rate of the Muon groups (a group's own ``lr`` wins).
        momentum: Muon's momentum factor.
        nesterov: Nesterov momentum (the update orthogonalised is ``g + momentum * m``).
        ns_steps: Newton-Schulz iterations.
        ns_dtype: dtype of the iterations, ``bfloat16`` (fast, the published setting) or ``float32``.
        rms_scale: the update is scaled by ``rms_scale * sqrt(max(rows, cols))``: RMS ~ rms_scale.
        weight_decay: decoupled weight decay of groups that do not set their own.
        adamw_lr, adamw_betas, adamw_eps: AdamW's settings for the other groups.
        qk_clip_tau: QK-clip's largest attention logit per head (MuonClip; None: off), applied by the run
            after each step (see the module docstring).
    """

    # Asks `trainer.optim.build_optimizer` for the hidden matrices as a group of their own (`use_muon`).
    hidden_matrix_group = True

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_dtype: str = "bfloat16", rms_scale: float = 0.2, weight_decay: float = 0.0,
                 adamw_lr: float = 3.0e-3, adamw_betas: tuple[float, float] | list[float] = (0.9, 0.95),
                 adamw_eps: float = 1.0e-8, qk_clip_tau: float | None = None) -> None:
        if qk_clip_tau is not None and not (math.isfinite(qk_clip_tau) and qk_clip_tau > 0):
            raise ValueError(f"qk_clip_tau must be a positive number (or None: off), got {qk_clip_tau}")
        if not lr >= 0.0 or not adamw_lr >= 0.0:
            raise ValueError(f"learning rates must be >= 0, got lr={lr}, adamw_lr={adamw_lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
        if ns_dtype not in _DTYPES:
            raise ValueError(f"ns_dtype must be one of {', '.join(_DTYPES)}, got {ns_dtype!r}")
        betas = tuple(float(b) for b in adamw_betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"adamw_betas must be two numbers in [0, 1), got {list(adamw_betas)}")
        # read by `add_param_group` (called by the base class's constructor) for each group's LR
        self._muon_lr, self._adamw_lr = float(lr), float(adamw_lr)
        defaults = dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=ns_dtype,
                        rms_scale=rms_scale, weight_decay=weight_decay, betas=betas, eps=adamw_eps,
                        use_muon=False)
        super().__init__(params, defaults)
        # Which ranks hold identical copies of a tensor outside any DTensor layout (DDP's replicas): set by the
        # strategy (`attach_replicas`); None is one process, or copies orthogonalised where they are.
        self.replica_mesh: ReplicaMesh | None = None
        # Matrices this rank has orthogonalised (an expert's counts once): what the tests check is
        # steps x matrices over all ranks together.
        self.ns_matrices = 0
        # QK-clip's threshold (None: off). The clip itself needs the forward's logits, so the run applies it
        # after each step (`trainer.models.qk_clip.QKClip`, built by `trainer.run.build_trainer`).
        self.qk_clip_tau = None if qk_clip_tau is None else float(qk_clip_tau)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # each kind of group gets its own LR unless it brings one
        param_group.setdefault("lr", self._muon_lr if param_group.get("use_muon") else self._adamw_lr)
        super().add_param_group(param_group)
        if param_group["use_muon"]:
            flat = [p for p in param_group["params"] if p.ndim < 2]
            if flat:
                raise ValueError(f"Muon orthogonalises matrices; its group got tensors of shape "
                                 f"{[tuple(p.shape) for p in flat]} (put them in an AdamW group)")

    def attach_replicas(self, replica_mesh: ReplicaMesh) -> None:
        """Tell the optimizer, for each tensor it steps, which ranks hold the same values outside the
        tensor's DTensor layout (the strategy's `replica_mesh`), so that one of them orthogonalises."""
        self.replica_mesh = replica_mesh

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group's momentum first, then the orthogonalisations of all of them together: the matrices
        # of one owner group share two all-to-alls per step (`_exchange`), whatever their parameter group.
        work: list[_Work] = []
        for group in self.param_groups:
            if group["use_muon"]:
                work += self._momentum_updates(group)
            else:
                self._adamw_step(group)
        self._orthogonalise_all(work)
        for item in work:
            group, local = item.group, _local(item.param)
            lr = group["lr"]
            if group["weight_decay"] != 0.0:
                local.mul_(1.0 - lr * group["weight_decay"])
            rows, cols = item.param.shape[-2], item.param.shape[-1]
            assert item.result is not None
            local.add_(item.result.to(local.dtype), alpha=-lr * group["rms_scale"] * math.sqrt(max(rows, cols)))
        return loss

    # ---- Muon ---------------------------------------------------------------------------------------
    def _momentum_updates(self, group: dict[str, Any]) -> list[_Work]:
        """Nesterov momentum on the local shards; the tensors to orthogonalise, with their layouts."""
        mu = group["momentum"]
        work = []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            grad, buf = _local(param.grad), _local(state["momentum_buffer"])
            buf.mul_(mu).add_(grad)
            update = grad.add(buf, alpha=mu) if group["nesterov"] else buf
            replicas = self.replica_mesh(param) if self.replica_mesh is not None else None
            layout = None if update.is_meta else _layout_of(param, replicas)
            work.append(_Work(param, group, update, layout))
        return work

    def _orthogonalise_all(self, work: list[_Work]) -> None:
        """Fill every item's `result`: NS of its whole matrices, in its local layout, each matrix computed
        once. Items whose layout allows it (one mesh dimension that splits a matrix dimension or replicates)
        are exchanged per owner group in two all-to-alls; the others (2-D meshes, FSDP2's strided shards)
        go through DTensor redistributes one by one. Every rank of a group sees the same items in the same
        order (the same parameters), so the collectives pair up."""
        batches: dict[tuple[Any, ...], list[_Work]] = {}
        for item in work:
            if item.update.is_meta:  # the planner's exact mode: shapes without values, nothing to compute
                item.result = torch.empty_like(item.update)
            elif item.layout is None:  # whole matrices here and nowhere else
                item.result = self._newton_schulz(item.update, item.group["ns_steps"],
                                                  _DTYPES[item.group["ns_dtype"]]).to(item.update.dtype)
            elif _exchangeable(item.layout, item.update):
                ranks = tuple(item.layout.mesh.mesh.flatten().tolist())
                batches.setdefault((ranks, item.update.dtype), []).append(item)
        for items in batches.values():
            self._exchange(items)
        owners: dict[tuple[int, tuple[int, ...]], int] = {}
        for item in work:
            if item.result is None:
                item.result = self._redistributed(item, owners)

    def _exchange(self, items: list[_Work]) -> None:
        """Owners round-robin over a 1-D group: every rank sends its piece of each matrix to the matrix's
        owner (nothing for replicated ones: the owner holds it whole), the owner runs Newton-Schulz, and
        sends every rank its piece of the result (the whole of a replicated one): two
        `all_to_all_single` per group and step, each moving (W - 1) / W of the pieces at most."""
        layout = items[0].layout
        assert layout is not None
        mesh = layout.mesh
        group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        dtype, device = items[0].update.dtype, items[0].update.device
        owner = [k % world for k in range(len(items))]
        dims = [_matrix_split(item.layout) for item in items]  # type: ignore[arg-type]

        def piece(k: int, rank: int) -> tuple[int, int]:  # (start, end) of `rank`'s piece along dims[k]
            size = items[k].layout.shape[dims[k]]  # type: ignore[union-attr]
            chunk = -(-size // world)
            start = min(rank * chunk, size)
            return start, min(start + chunk, size)

        def numel(k: int, rows: int) -> int:
            shape = items[k].layout.shape  # type: ignore[union-attr]
            return rows * math.prod(shape) // max(shape[dims[k]], 1) if shape[dims[k]] else 0

        # 1. pieces to their owners (a replicated matrix sends nothing: its owner has it)
        send_sizes, sends = [0] * world, [[] for _ in range(world)]  # type: list[int], list[list[torch.Tensor]]
        receive_sizes = [0] * world
        for k, item in enumerate(items):
            if dims[k] is None:
                continue
            start, end = piece(k, me)
            sends[owner[k]].append(item.update.reshape(-1))
            send_sizes[owner[k]] += numel(k, end - start)
            if owner[k] == me:
                for rank in range(world):
                    start, end = piece(k, rank)
                    receive_sizes[rank] += numel(k, end - start)
        received = self._all_to_all(sends, send_sizes, receive_sizes, dtype, device, group)
        # 2. whole matrices on their owners, orthogonalised
        offsets = [0] * world
        results: dict[int, torch.Tensor] = {}
        for k, item in enumerate(items):
            if owner[k] != me:
                continue
            if dims[k] is None:
                whole = item.update
            else:
                parts = []
                for rank in range(world):
                    start, end = piece(k, rank)
                    count = numel(k, end - start)
                    shape = list(item.layout.shape)  # type: ignore[union-attr]
                    shape[dims[k]] = end - start
                    parts.append(received[rank][offsets[rank]:offsets[rank] + count].view(shape))
                    offsets[rank] += count
                whole = torch.cat(parts, dim=dims[k])
            results[k] = self._newton_schulz(whole, item.group["ns_steps"],
                                             _DTYPES[item.group["ns_dtype"]]).to(dtype)
        # 3. each rank's piece of every result back (the whole of a replicated one)
        sends, send_sizes, receive_sizes = [[] for _ in range(world)], [0] * world, [0] * world
        for k, item in enumerate(items):
            for rank in range(world):
                if dims[k] is None:
                    size = item.update.numel()
                else:
                    start, end = piece(k, rank)
                    size = numel(k, end - start)
                if owner[k] == me:
                    out = results[k] if dims[k] is None else results[k].narrow(dims[k], start, end - start)
                    sends[rank].append(out.reshape(-1))
                    send_sizes[rank] += size
                if rank == me:
                    receive_sizes[owner[k]] += size
        received = self._all_to_all(sends, send_sizes, receive_sizes, dtype, device, group)
        offsets = [0] * world
        for k, item in enumerate(items):
            size = item.update.numel()
            item.result = received[owner[k]][offsets[owner[k]]:offsets[owner[k]] + size].view(item.update.shape)
            offsets[owner[k]] += size

    @staticmethod
    def _all_to_all(sends: list[list[torch.Tensor]], send_sizes: list[int], receive_sizes: list[int],
                    dtype: torch.dtype, device: torch.device, group: Any) -> list[torch.Tensor]:
        """One `all_to_all_single` of the concatenated `sends[rank]`; what came from each rank."""
        import torch.distributed as dist

        flat = [t for chunks in sends for t in chunks]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        receive = torch.empty(sum(receive_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(receive, send, receive_sizes, send_sizes, group=group)
        return list(receive.split(receive_sizes))

    def _redistributed(self, item: _Work, owners: dict[tuple[int, tuple[int, ...]], int]) -> torch.Tensor:
        """This rank's part of NS(whole matrices of the item's update), through DTensor: the split matrix
        dimensions all-gathered, the owner's result (zeros elsewhere) redistributed from Partial back to the
        tensor's placements."""
        layout, update, group = item.layout, item.update, item.group
        assert layout is not None
        steps, dtype = group["ns_steps"], _DTYPES[group["ns_dtype"]]
        whole = DTensor.from_local(update, layout.mesh, layout.placements, run_check=False, shape=layout.shape,
                                   stride=layout.stride)
        if layout.gathered != layout.placements:
            whole = whole.redistribute(layout.mesh, layout.gathered)  # all-gather the split matrix dimensions
        matrices = whole.to_local()
        key = (id(layout.mesh), layout.group_dims)
        turn = owners.get(key, 0)
        owners[key] = turn + 1
        if turn % layout.group_size == layout.my_index():
            result = self._newton_schulz(matrices, steps, dtype).to(update.dtype)
        else:
            result = torch.zeros_like(matrices)
        # the owner's result, everyone else's zeros, summed into each rank's own placement
        partial = tuple(Partial() if d in layout.group_dims else p for d, p in enumerate(layout.gathered))
        summed = DTensor.from_local(result, layout.mesh, partial, run_check=False, shape=layout.shape,
                                    stride=layout.stride)
        return summed.redistribute(layout.mesh, layout.placements).to_local()

    def _newton_schulz(self, matrices: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
        if matrices.numel() == 0:  # a ZeRO row view may hold no rows of a small tensor
            return matrices.clone()
        self.ns_matrices += matrices.numel() // (matrices.shape[-2] * matrices.shape[-1])
        return newton_schulz(matrices, steps, dtype)

    # ---- AdamW --------------------------------------------------------------------------------------
    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            params.append(_local(param))
            grads.append(_local(param.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        from torch.optim.adam import adam
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        # torch's own AdamW arithmetic on the local shards (element-wise: any layout is stepped where it is),
        # with the fused kernel where it runs (as `optimizer=adamw` does by default)
        fused = all(p.device.type in _get_fused_kernels_supported_devices() and p.is_floating_point()
                    for p in params) and len({p.dtype for p in params}) == 1
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=fused or None, foreach=None if fused else False,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


@dataclass
class MuonConfig:
    """Schema of ``conf/optimizer/muon.yaml`` (:class:`Muon`): Muon for the hidden weight matrices, AdamW
    for embeddings, the output layer, norms and biases, each with its own learning rate."""

    _target_: str = "trainer.plugins.optimizers.Muon"
    # Must stay true: parameters are supplied by the trainer.
    _partial_: bool = True
    # Peak learning rate of the Muon group (hidden matrices); LR schedules multiply it.
    lr: float = 0.02
    # Momentum factor of the Muon group.
    momentum: float = 0.95
    # Nesterov momentum: orthogonalise g + momentum * m instead of m.
    nesterov: bool = True
    # Newton-Schulz iterations (5: the published quintic's setting).
    ns_steps: int = 5
    # dtype of the Newton-Schulz iterations: bfloat16 (the published setting, fast on GPUs) or float32
    # (exact comparisons: the parity tests).
    ns_dtype: str = "bfloat16"
    # The orthogonalised update times rms_scale * sqrt(max(rows, cols)) has an RMS of about rms_scale, AdamW's
    # typical update RMS (Moonlight: 0.2), so AdamW's LR and weight decay carry over.
    rms_scale: float = 0.2
    # Decoupled weight decay, of the Muon group and of AdamW's "decay" group (not of embeddings, norms, biases).
    weight_decay: float = 0.1
    # Peak learning rate of the AdamW groups (embeddings, output layer, norms, biases).
    adamw_lr: float = 3.0e-3
    # AdamW's moment decay rates and epsilon for those groups.
    adamw_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    adamw_eps: float = 1.0e-8
    # QK-clip (MuonClip, Kimi K2): after each step, every attention head whose largest pre-softmax logit of
    # the step's batch exceeded this has its query/key projection rows scaled so that it would be this
    # (Kimi K2 used 100); None: off. Llama-family models only (validation refuses the others).
    qk_clip_tau: Optional[float] = None
