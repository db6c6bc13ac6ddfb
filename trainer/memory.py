"""Bytes of training state this rank holds: its local shards of parameters, gradients, optimizer states."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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


def state_bytes(model_parts: Iterable[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """{params, grads, optimizer} bytes held by this rank (measured while gradients exist)."""
    params = [p for part in model_parts for p in part.parameters()]
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        # scalar step counters are bookkeeping, not the states the ZeRO formulas count
        "optimizer": _bytes(v for v in states if v.dim() > 0),
    }
