"""Bytes of training state this rank holds: its local shards of parameters, gradients, optimizer states."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's bytes: a DTensor's local shard, and inside wrapper subclasses
    (torchao's float8 weight wrapper under FSDP2) the tensor they wrap."""
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
        tensor = getattr(tensor, inner[0])
    return tensor


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum over distinct memory, so a tensor seen twice (tied weights) counts once."""
    seen: dict[tuple[int, int], int] = {}
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta" or local.numel() == 0:
            continue
        # keyed by address, not id(): to_local() returns a new Python object each time
        seen[(local.data_ptr(), local.numel())] = local.numel() * local.element_size()
    return sum(seen.values())


def storage_address(tensor: torch.Tensor) -> int:
    """Address of the storage holding this rank's bytes of `tensor` (0 on the meta device): two tensors
    with the same address share memory (a view, not a copy)."""
    local = _local(tensor)
    return 0 if local.device.type == "meta" else local.untyped_storage().data_ptr()


def state_bytes(model_parts: Iterable[nn.Module], optimizer: torch.optim.Optimizer,
                stand_ins: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """{params, grads, optimizer} bytes held by this rank (measured while gradients exist).

    `optimizer` counts the states and the tensors the optimizer steps in place of parameters that are
    copies, not views, of them (bf16_true's fp32 master weights); ZeRO-1's sharded views share their
    parameter's storage and are not counted again. `grads` counts the parameters' gradients and those the
    stepped tensors or the strategy's `stand_ins` hold in storage of their own (ZeRO-2's partition). On a
    GPU, `host` is the part of those bytes in host memory (offloaded)."""
    params = [p for part in model_parts for p in part.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    param_storages = {storage_address(p) for p in params}
    stepped = [t for group in optimizer.param_groups for t in group["params"]]
    copies = [t for t in stepped if storage_address(t) not in param_storages]
    grads = [p.grad for p in params if p.grad is not None]
    # gradients the optimizer's tensors hold in storage of their own (ZeRO-2's reduce-scattered rows)
    grad_storages = {storage_address(g) for g in grads}
    grads += [t.grad for t in [*stepped, *stand_ins] if t.grad is not None and storage_address(t.grad) not in grad_storages]
    kinds = {"params": params, "grads": grads,
             # scalar step counters are bookkeeping, not the states the ZeRO formulas count
             "optimizer": [v for v in states if v.dim() > 0] + copies}
    held = {kind: _bytes(tensors) for kind, tensors in kinds.items()}
    if any(_local(p).device.type == "cuda" for p in params):
        # offloaded states (FSDP's CPUOffloadPolicy, ZeRO-Offload's optimizer) sit in host memory
        held["host"] = sum(_bytes(t for t in tensors if _local(t).device.type == "cpu") for tensors in kinds.values())
    return held
