"""`optimizer=sgd`: torch's own :class:`torch.optim.SGD`, configured by :class:`SGDConfig`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SGDConfig"]


@dataclass
class SGDConfig:
    """Schema of ``conf/optimizer/sgd.yaml`` (:class:`torch.optim.SGD`)."""

    _target_: str = "torch.optim.SGD"
    # Must stay true: parameters are supplied by the trainer.
    _partial_: bool = True
    # Peak learning rate; LR schedules multiply this value.
    lr: float = 0.1
    # Momentum factor (0 disables momentum).
    momentum: float = 0.9
    # Nesterov momentum (requires momentum > 0).
    nesterov: bool = False
    # L2 penalty added to the gradient, applied only to the "decay" parameter group.
    weight_decay: float = 0.0
