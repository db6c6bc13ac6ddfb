"""Dynamic loss scaling for fp16: the scale's state machine and the unscale-and-check of gradients.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large scale S
lifts the backward's values into range; the gradients are divided by S again before clipping and the
optimizer step. Too large an S overflows to inf/nan: that step is skipped and S reduced. The policy is
Megatron-LM's / DeepSpeed's (growth, backoff, hysteresis, floor), with DeepSpeed's "consecutive"
hysteresis: a step without overflow restores the tolerance.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class DynamicLossScaler:
    """The loss scale and the counters that move it; pure Python, one `update` per optimizer step.

    - No overflow for `growth_interval` consecutive steps: scale x `growth_factor`.
    - Overflow: the step is skipped; on the `hysteresis`-th consecutive overflow (and every further one
      until a step succeeds) scale x `backoff_factor`, never below `min_scale`. With the default
      hysteresis of 1, every overflow reduces the scale.

    Growth and backoff by powers of two keep the scale a power of two, so scaling and unscaling are
    exact in floating point.
    """

    def __init__(self, initial_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1, min_scale: float = 1.0) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(f"initial_scale and min_scale must be positive, got {initial_scale} and {min_scale}")
        if initial_scale < min_scale:
            raise ValueError(f"initial_scale={initial_scale} is below min_scale={min_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1 (1: every overflow reduces the scale), got {hysteresis}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.scale = float(initial_scale)
        # Consecutive steps without overflow since the last growth or overflow.
        self.growth_tracker = 0
        # Overflows still tolerated before the next backoff (restored by any step without overflow).
        self.hysteresis_left = hysteresis
        # Steps skipped so far because of an overflow.
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        """Move the scale after one step's overflow check (the same `found_inf` on every rank)."""
        if found_inf:
            self.skipped_steps += 1
            self.growth_tracker = 0
            self.hysteresis_left = max(self.hysteresis_left - 1, 0)
            if self.hysteresis_left == 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.hysteresis_left = self.hysteresis
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_left": self.hysteresis_left, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank stores: a DTensor's local shard (sharing its storage), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def unscale_and_check_(grads: Iterable[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply every gradient by `inv_scale` in place; return 1.0 if any value was inf/nan, else 0.0.

    DTensor gradients (FSDP shards, tensor-parallel shards, partial sums) are checked on their local
    shard: an overflow anywhere shows up on the rank that holds it, and the caller agrees across ranks.
    Uses torch's fused kernel (the one `GradScaler` uses), one call per device and dtype.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        local = local_tensor(grad)
        if local.numel():
            groups[(local.device, local.dtype)].append(local)
    found: list[torch.Tensor] = []
    for (device, _), tensors in groups.items():
        found_inf = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, torch.full((1,), inv_scale,
                                                                                         device=device))
        found.append(found_inf)
    if not found:
        return torch.zeros(1)
    device = found[0].device
    return torch.stack([f.to(device) for f in found]).amax().reshape(1)


def agree_on_overflow(found_inf: torch.Tensor) -> bool:
    """True if any rank of the job found an overflow.

    The flag is reduced over the whole world, not one mesh dimension: data-parallel replicas and shards,
    tensor-parallel shards and pipeline stages each hold different gradients, and a step skipped on one
    rank must be skipped on all of them, or the replicas drift apart and the shards stop matching.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        found_inf = found_inf.clone()
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item())
