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
2. the update's shards are gathered to whole matrices: ``DTensor.redistribute`` from the matrix's
   placements to ``Replicate`` on the mesh dimensions that split a matrix dimension (an all-gather; a
   dimension that splits a batch of matrices, the experts of a MoE layer, stays split: those matrices
   are whole already). Under tensor parallelism this is the gather over the tp group (the math does not
   allow orthogonalising per shard: NS of a column block is not a block of NS);
3. owners go round-robin over the ranks that now hold the same whole matrices (the gathered dimensions,
   replicated ones, and the copies a strategy keeps outside any DTensor layout: DDP's data-parallel ranks,
   `Strategy.replica_mesh`), so the work is spread over the data-parallel ranks;
4. the owner runs Newton-Schulz, every other rank contributes zeros, and one ``redistribute`` from
   ``Partial`` back to the matrix's own placements (a reduce-scatter, or an all-reduce for replicated
   dimensions) hands every rank its shard of the result: exact, since x + 0 = x.

Expert weights (3-D, ``experts x rows x cols``) are orthogonalised per expert, as a batch of matrices.
QK-clip (MuonClip, Kimi K2) is not implemented.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
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
    """

    # Asks `trainer.optim.build_optimizer` for the hidden matrices as a group of their own (`use_muon`).
    hidden_matrix_group = True

    def __init__(self, params: Iterable[Any], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, ns_dtype: str = "bfloat16", rms_scale: float = 0.2, weight_decay: float = 0.0,
                 adamw_lr: float = 3.0e-3, adamw_betas: tuple[float, float] | list[float] = (0.9, 0.95),
                 adamw_eps: float = 1.0e-8) -> None:
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
        owners: dict[tuple[int, tuple[int, ...]], int] = {}  # round-robin position per owner group
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group, owners)
            else:
                self._adamw_step(group)
        return loss

    # ---- Muon ---------------------------------------------------------------------------------------
    def _muon_step(self, group: dict[str, Any], owners: dict[tuple[int, tuple[int, ...]], int]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param)
            grad, buf = _local(param.grad), _local(state["momentum_buffer"])
            buf.mul_(mu).add_(grad)
            update = grad.add(buf, alpha=mu) if group["nesterov"] else buf
            orthogonal = self._orthogonalised(param, update, group, owners)
            local = _local(param)
            if wd != 0.0:
                local.mul_(1.0 - lr * wd)
            rows, cols = param.shape[-2], param.shape[-1]
            local.add_(orthogonal.to(local.dtype), alpha=-lr * group["rms_scale"] * math.sqrt(max(rows, cols)))

    def _orthogonalised(self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any],
                        owners: dict[tuple[int, tuple[int, ...]], int]) -> torch.Tensor:
        """This rank's part of NS(whole matrices of `update`), in `update`'s local layout."""
        steps, dtype = group["ns_steps"], _DTYPES[group["ns_dtype"]]
        if update.is_meta:  # the planner's exact mode: shapes without values, nothing to gather or compute
            return torch.empty_like(update)
        replicas = self.replica_mesh(param) if self.replica_mesh is not None else None
        layout = _layout_of(param, replicas)
        if layout is None:  # whole matrices here and nowhere else
            return self._newton_schulz(update, steps, dtype)
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
