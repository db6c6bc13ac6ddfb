"""`optimizer=adamw`: torch's own :class:`torch.optim.AdamW`, configured by :class:`AdamWConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AdamWConfig"]


@dataclass
class AdamWConfig:
    """Schema of ``conf/optimizer/adamw.yaml`` (:class:`torch.optim.AdamW`)."""

    _target_: str = "torch.optim.AdamW"
    # Must stay true: parameters are supplied by the trainer.
    _partial_: bool = True
    # Peak learning rate; LR schedules multiply this value.
    lr: float = 3.0e-3
    # Exponential decay rates of the first and second moment estimates.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Added to the denominator for numerical stability.
    eps: float = 1.0e-8
    # Decoupled weight decay, applied only to the "decay" parameter group.
    weight_decay: float = 0.1
    # Fused kernel. null: fused wherever torch has the kernel for every tensor the optimizer steps (plain
    # floating tensors or DTensor shards on CPU or CUDA; torchtitan's default too), else torch's choice; on
    # CPU torch would otherwise step tensor by tensor: 4.7x slower on ZeRO-1's row views of the tiny model
    # (benchmarks/optimizer_step.py, docs/BENCHMARKS.md).
    fused: bool | None = None
    # Multi-tensor implementation (null: let torch choose). Setting it turns the automatic fused kernel off.
    foreach: bool | None = None
