"""Learning-rate schedules (LR multipliers for ``LambdaLR``) and their Hydra schemas.

Build one from the ``lr_schedule`` config group::

    schedule = hydra.utils.instantiate(cfg.lr_schedule)(total_steps=N)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
"""

from .configs import (
    SCHEMAS,
    ConstantScheduleConfig,
    CosineScheduleConfig,
    InverseSqrtScheduleConfig,
    LinearScheduleConfig,
    WSDScheduleConfig,
)
from .schedules import (
    WSD,
    Constant,
    DecayShape,
    InverseSqrt,
    LRSchedule,
    WarmupCosine,
    WarmupLinear,
)

__all__ = [
    "LRSchedule",
    "Constant",
    "WarmupCosine",
    "WarmupLinear",
    "WSD",
    "DecayShape",
    "InverseSqrt",
    "ConstantScheduleConfig",
    "CosineScheduleConfig",
    "LinearScheduleConfig",
    "WSDScheduleConfig",
    "InverseSqrtScheduleConfig",
    "SCHEMAS",
]
