"""Tensor parallelism (Megatron-LM style), `strategy=tp`, and the pieces `strategy=3d` shares with it.

How each module is split is the plan in `tensor_parallel_plan.py` (`apply_tensor_parallel`, re-exported
here). This file has what follows the split: gradients kept in their parameters' layouts
(`keep_grads_in_param_layout`, `settle_tensor_parallel_grads`), the initialization of sharded weights
(`materialize_tensor_parallel`), the size checks before launch (`check_tensor_parallel_sizes`), and the
`TensorParallel` strategy that calls them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainer.models import family_of
from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.plugins.strategies.distributed import DistributedStrategy
from trainer.plugins.strategies.tensor_parallel_plan import ReplicateParallel, apply_tensor_parallel

__all__ = [
    "TensorParallel", "TensorParallelConfig", "ReplicateParallel", "apply_tensor_parallel",
    "keep_grads_in_param_layout", "settle_tensor_parallel_grads", "materialize_tensor_parallel",
    "check_tensor_parallel_sizes",
]


def settle_tensor_parallel_grads(model_parts: Sequence[nn.Module]) -> None:
    """Bring every DTensor gradient to its parameter's placements, once per optimizer step.

    Under sequence parallelism the norms' weights get Partial(sum) gradients (each rank summed over its
    own sequence shard). That is correct, and DTensor would reduce them lazily, but then every consumer
    (the norm for clipping, then the optimizer) would pay the all-reduce again; here it is paid once.
    (The embedding's Replicate gradient is sliced as it is produced, by `keep_grads_in_param_layout`;
    anything left in another layout is converted here too.) Every strategy with tensor parallelism (tp,
    3d) calls it first thing in `clip_grad_norm`. Skipping it costs time, not correctness.
    """
    for part in model_parts:
        for param in part.parameters():
            grad = param.grad
            if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)


def keep_grads_in_param_layout(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Convert, as autograd produces them, gradients that reach a tp-sharded parameter replicated.

    The vocab-parallel embedding's backward yields a full-size Replicate gradient for its Shard(0)
    weight; slicing it to the parameter's shard is local (no communication), so doing it per backward
    keeps a single full-vocabulary gradient from being accumulated over the micro-batches, and makes the
    stored gradient match its parameter's shape on every rank (which a pipeline's all-reduce of the tied
    embedding/head gradient between stages relies on). Partial gradients need an all-reduce and are left
    to `settle_tensor_parallel_grads`, once per step.

    Register after materialization: `to_empty` swaps parameter storage and drops tensor hooks.
    Parameters managed by FSDP (on a larger mesh) are skipped: FSDP redistributes their gradients itself.
    """

    def make_hook(param: DTensor) -> Any:
        def to_param_layout(grad: torch.Tensor) -> torch.Tensor:
            if (isinstance(grad, DTensor) and grad.placements != param.placements
                    and not any(p.is_partial() for p in grad.placements)):
                return grad.redistribute(param.device_mesh, param.placements)
            return grad
        return to_param_layout

    seen: set[int] = set()
    for param in model.parameters():
        if (id(param) not in seen and isinstance(param, DTensor) and param.requires_grad
                and param.device_mesh == tp_mesh and any(p.is_shard() for p in param.placements)):
            seen.add(id(param))
            param.register_hook(make_hook(param))


def check_tensor_parallel_sizes(model_cfg: Any, tp: int, seq_len: int, sequence_parallel: bool = True) -> None:
    """Raise ValueError (one line) when `model_cfg` cannot be split over `tp` >= 2 ranks.

    Sizes are not padded: tp must divide the query heads, the key/value heads, the MLP hidden width and
    the vocabulary (and, with sequence parallelism, the sequence length).
    """
    problems = _divisibility_problems(model_cfg, tp)
    if sequence_parallel and seq_len % tp:
        problems.append(f"trainer.seq_len={seq_len} (sequence parallelism) is not divisible by tp={tp}")
    if problems:
        raise ValueError(f"cannot split model {model_cfg.name} over tp={tp} ranks: " + "; ".join(problems))


def _divisibility_problems(model_cfg: Any, tp: int) -> list[str]:
    problems = []
    for key, value, what in family_of(model_cfg).tensor_parallel_sizes(model_cfg):
        if value % tp == 0:
            continue
        problem = f"{key}={value} ({what}) is not divisible by tp={tp}"
        if key == "model.vocab_size":
            # Not padded silently (it changes the model and its checkpoints); Megatron-LM pads to 128 x tp.
            multiple = 128 * tp
            problem += f" (pad it: model.vocab_size={-(-value // multiple) * multiple}, a multiple of 128 x tp)"
        problems.append(problem)
    return problems


def materialize_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh | None,
                                materialize: Callable[[nn.Module], None]) -> None:
    """Allocate and initialize the weights with `materialize` (`to_empty` + `init_weights`): the whole
    model before TP (init=full, bitwise the single-process weights), or only this rank's shards after it
    (init=sharded, auto for big models). `tp_mesh` is None without tensor parallelism.

    For the sharded case on CUDA, DTensor's offset-based RNG gives each shard its slice of the
    single-process random stream. Devices without it (the CPU) would draw the same values on every tp
    rank, so every rank's heads would start, and stay, identical copies of each other; there each tp
    rank draws from its own seed instead (not the single-process weights: use init=full for those),
    and replicated parameters are then made equal by a broadcast from the first tp rank.
    """
    # the full init (before TP) draws the whole model, like one process: nothing to change there
    sharded = tp_mesh is not None and any(isinstance(p, DTensor) for p in model.parameters())
    if not sharded or _dtensor_rng_supported(tp_mesh):
        materialize(model)
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed() + 1 + tp_mesh.get_local_rank())
        materialize(model)
    group = tp_mesh.get_group()
    with torch.no_grad():
        for param in model.parameters():
            if isinstance(param, DTensor) and param.device_mesh == tp_mesh and all(
                    p.is_replicate() for p in param.placements):
                dist.broadcast(param.to_local(), src=dist.get_global_rank(group, 0), group=group)


def _dtensor_rng_supported(mesh: DeviceMesh) -> bool:
    from torch.distributed.tensor._random import is_rng_supported_mesh

    with warnings.catch_warnings():  # it warns on every call for the CPU
        warnings.simplefilter("ignore")
        return is_rng_supported_mesh(mesh)


class TensorParallel(DistributedStrategy):
    """Tensor parallelism over all ranks (tp = world size): every rank sees the whole batch and holds
    1/tp of each block's weights.

    The hooks follow the order every strategy applies to the model: 1. pipeline split (none here) ->
    2. tensor parallel (`apply_model_parallel`: `apply_tensor_parallel` on the part) -> 3. activation
    checkpointing -> 4. compile (both done by `DistributedStrategy.setup_model`) -> 5. data-parallel
    wrapping (none here). The pieces are module functions, shared with `strategy=3d`. Gradients are
    brought to their parameters' layouts in `clip_grad_norm` (`settle_tensor_parallel_grads`).
    """

    name = "tp"
    uses_tp = True
    uses_dp = False

    def __init__(self, sequence_parallel: bool = True, loss_parallel: bool = True, init: str = "auto",
                 name: str | None = None) -> None:
        super().__init__(init=init, name=name)
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel

    # ---- checks and layout (config validation and the planner call these before launch) ------------
    @classmethod
    def check_tensor_parallel(cls, model_cfg: Any, tp: int, seq_len: int, sequence_parallel: bool = True) -> None:
        """Raise ValueError (one line) when `model_cfg` cannot be split over `tp` ranks (called by
        `trainer.config` before any process starts); tp=1 splits nothing."""
        if tp == 1:
            raise ValueError(f"strategy={cls.name} needs tp >= 2 (tp=1 splits nothing): e.g. tp=2 "
                             "trainer.devices=2, or strategy=single for one process")
        check_tensor_parallel_sizes(model_cfg, tp, seq_len, sequence_parallel)

    def planner_layout(self, dp: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
        return {**super().planner_layout(dp, tp, pp, cp), "tp": tp, "sequence_parallel": self.sequence_parallel,
                "loss_parallel": self.loss_parallel}

    # ---- model (in the fixed order) -----------------------------------------------------------------
    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D tensor-parallel mesh (None with tp=1)."""
        return self.dims.mesh["tp"] if self.dims.tp_enabled else None

    def apply_model_parallel(self, model: nn.Module) -> None:
        """2. tensor parallel: shard the part's Linear weights, embedding and head over the tp mesh."""
        if self.tp_mesh is not None:
            apply_tensor_parallel(model, self.tp_mesh, sequence_parallel=self.sequence_parallel,
                                  loss_parallel=self.loss_parallel)

    def materialize(self, model: nn.Module) -> None:
        materialize_tensor_parallel(model, self.tp_mesh, super().materialize)

    def setup_model(self, model: nn.Module, activation_checkpointing: ActivationCheckpointing,
                    compile: bool) -> list[nn.Module]:
        parts = super().setup_model(model, activation_checkpointing, compile)
        if self.tp_mesh is not None:
            for part in parts:  # after materialization, which drops tensor hooks
                keep_grads_in_param_layout(part, self.tp_mesh)
        return parts

    # ---- step ---------------------------------------------------------------------------------------
    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        settle_tensor_parallel_grads(model_parts)
        return super().clip_grad_norm(model_parts, max_norm)


@dataclass
class TensorParallelConfig:
    """Schema of `strategy=tp`: tensor parallelism over `tp` = trainer.devices x trainer.num_nodes ranks."""

    _target_: str = "trainer.plugins.strategies.TensorParallel"
    # Name in logs and summaries.
    name: str = "tp"
    # Shard norms and the residual stream on the sequence (activation memory / tp; reduce-scatter +
    # all-gather instead of all-reduce). Needs tp to divide trainer.seq_len.
    sequence_parallel: bool = True
    # Keep the logits sharded on the vocabulary and compute the cross entropy on the shards.
    loss_parallel: bool = True
    # Weight initialization: auto (full when the fp32 weights fit in 4 GiB), full (every rank builds the
    # whole model, bitwise the single-process weights, then keeps its shard) or sharded (each rank
    # initializes only its shards; for big models).
    init: str = "auto"
