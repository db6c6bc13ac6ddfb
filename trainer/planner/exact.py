"""Exact mode: build the real model on the meta device, apply the real strategy as one rank of the
configured world under torch's fake process group, and count what that rank holds.

Nothing is allocated (meta tensors have shapes, not storage) and nothing is communicated (the fake
backend's collectives return at once), so any world size and model size is counted in seconds on a
laptop. The strategy runs its own `setup_model` (pipeline split, tensor parallelism, checkpointing
wrappers, DDP/FSDP wrapping) and `build_optimizer` (ZeRO-1 builds it over its sharded views); every
trainable parameter then gets a gradient in its own layout, as a backward leaves it (DDP: the whole
parameter; FSDP2: its shard; tensor parallelism: the local shard), and one optimizer step creates the
optimizer states. A precision that keeps fp32 master weights (`bf16_true`) gets its own
`FP32MasterWeights` installed, so the optimizer steps fp32 copies as in a run. The bytes are counted like
`trainer.memory.state_bytes` counts a real run's: distinct parameters, their gradients, and the
optimizer's non-scalar state tensors, plus the master copies (which a run's count leaves out).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor

from trainer.interfaces.precision import Precision


class ExactUnavailable(RuntimeError):
    """Exact counting could not run for this configuration (the reason is the message)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # type: ignore[attr-defined]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


@contextlib.contextmanager
def _ddp_without_init_sync() -> Iterator[None]:
    """DistributedDataParallel's constructor checks parameter shapes across ranks by reading a value
    (`.item()`), which meta tensors do not have; `init_sync=False` skips that check and the initial
    broadcast, neither of which changes what a rank holds."""
    import trainer.plugins.strategies.ddp as ddp_module

    patched = functools.partial(ddp_module.DistributedDataParallel, init_sync=False)
    with mock.patch.object(ddp_module, "DistributedDataParallel", patched):
        yield


class _StepOnShapes(Precision):
    """The optimizer step of exact mode: every tensor the optimizer updates gets a gradient of its own
    layout if it has none (master copies, views), then one plain step creates the states. Nothing reads a
    value (meta tensors have none): no loss-scale or overflow check."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        for group in optimizer.param_groups:
            for tensor in group["params"]:
                if tensor.grad is None:
                    tensor.grad = torch.empty_like(tensor)
        optimizer.step()
        return True


def count_state_bytes(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                      masters: Iterable[torch.Tensor] = (),
                      stand_ins: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> dict[str, int]:
    """{params, grads, optimizer} bytes of meta (or real) model parts, distinct parameters counted once;
    `masters` are fp32 master copies the precision plugin keeps for the optimizer (counted with it);
    `stand_ins` are the strategy's (parameter, what the optimizer steps) pairs, whose gradient counts when
    the parameter's own has moved there (ZeRO-2's reduce-scattered rows)."""
    params = list({id(p): p for part in model_parts for p in part.parameters()}.values())
    states = [v for state in optimizer.state.values() for v in state.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    moved = [stand_in.grad for param, stand_in in stand_ins if param.grad is None and stand_in.grad is not None]
    return {
        "params": _nbytes(params),
        "grads": _nbytes(p.grad for p in params if p.grad is not None) + _nbytes(moved),
        "optimizer": _nbytes(states) + _nbytes(masters),
    }


def exact_state_bytes(cfg: DictConfig, rank: int) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes `rank` holds after the first step of `cfg`'s run."""
    from trainer.config import world_size

    if dist.is_available() and dist.is_initialized():
        raise ExactUnavailable("a process group already exists in this process; exact mode needs its own fake one")
    world = world_size(cfg)
    if not 0 <= rank < world:
        raise ExactUnavailable(f"rank {rank} is outside the world of {world} ranks")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        with warnings.catch_warnings():
            # Meta tensors draw no random numbers: DTensor's caution about random ops on a CPU mesh does
            # not apply to what is counted here.
            warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
            return _count_on_meta(cfg, rank, world)
    finally:
        dist.destroy_process_group()


def _count_on_meta(cfg: DictConfig, rank: int, world: int) -> dict[str, int]:
    from trainer.config import data_parallel_size
    from trainer.models import build_meta_model
    from trainer.parallel_dims import ParallelDims

    try:
        strategy = instantiate(cfg.strategy)
        strategy.rank, strategy.world_size, strategy.local_rank = rank, world, 0
        strategy.device = torch.device("meta")
        dp = data_parallel_size(cfg)
        replicate, shard = strategy.data_parallel_split(dp) if strategy.uses_dp else (1, 1)
        tp = int(cfg.tp) if strategy.uses_tp else 1
        pp = int(cfg.pp) if strategy.uses_pp else 1
        cp = int(cfg.cp) if strategy.uses_cp else 1
        strategy.parallel_dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp,
                                              world_size=world, ep=int(cfg.get("ep", 1)))
        strategy.parallel_dims.build_mesh("cpu")
        precision = instantiate(cfg.precision)
        strategy.connect_precision(precision)
        model = build_meta_model(OmegaConf.to_object(cfg.model))
        with _ddp_without_init_sync():
            parts = strategy.setup_model(model, instantiate(cfg.activation_checkpointing), False)
        # as in a run, the precision plugin sees the optimizer first (bf16_true: its fp32 master copies)
        optimizer = strategy.build_optimizer(cfg.optimizer, parts)
        for part in parts:
            for param in part.parameters():
                if param.requires_grad:
                    param.grad = torch.empty_like(param)
        strategy.reduce_gradients(parts)
        masters = [master for _, master in precision.optimizer_tensor_pairs()]
        strategy.connect_precision(_StepOnShapes())
        strategy.optimizer_step(optimizer)
        return count_state_bytes(parts, optimizer, masters, strategy.optimizer_tensor_pairs())
    except ExactUnavailable:
        raise
    except Exception as error:  # noqa: BLE001 - any failure means the same thing: no exact figure
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ExactUnavailable(f"{type(error).__name__}: {first}") from error
