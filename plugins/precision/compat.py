"""Which precision a strategy can honour: checked by `trainer.config.validate` before any process starts.

Each rule is something that fails or silently does the wrong thing when tried (see
tests/test_precision.py), reported as one line naming the precision and the strategy option.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.plugins.precision.base import DTYPE_NAMES, Precision

def _strategy_label(strategy: Any) -> str:
    name = getattr(strategy, "name", type(strategy).__name__)
    flavour = getattr(strategy, "data_parallel", None)
    return f"strategy={name}" + (f" (data_parallel={flavour})" if flavour else "")


def check_precision_strategy(precision: Precision, strategy: Any, device_type: str) -> None:
    """Raise ValueError (one line naming both) when `strategy` on `device_type` cannot honour `precision`."""
    from trainer.plugins.strategies.ddp import DDP  # the strategies import this package: import at call time

    label = f"precision={precision.name}"
    where = _strategy_label(strategy)
    grad_dtype = precision.param_dtype
    reduce_dtype = precision.reduce_dtype

    # ddp and zero1 reduce through DistributedDataParallel, which all-reduces each gradient in the
    # gradient's own dtype (only a comm hook changes that): another reduce_dtype would be ignored.
    if isinstance(strategy, DDP) and reduce_dtype is not None and reduce_dtype != grad_dtype:
        hooks = {torch.bfloat16: " (or strategy.comm_hook=bf16, CUDA only)",
                 torch.float16: " (or strategy.comm_hook=fp16)"}
        raise ValueError(
            f"{label} with precision.reduce_dtype={DTYPE_NAMES[reduce_dtype]}: {where} all-reduces the "
            f"{DTYPE_NAMES[grad_dtype]} gradients in their own dtype and cannot honour it; set "
            f"precision.reduce_dtype={DTYPE_NAMES[grad_dtype]}{hooks.get(reduce_dtype, '')}, or pick strategy=zero2, "
            "zero3 or fsdp, whose FSDP2 mixed-precision policy reduces in the requested dtype")

    if device_type == "cuda" and precision.compute_dtype == torch.bfloat16 and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{label}: this GPU ({torch.cuda.get_device_name()}) has no bf16 support "
                         "(it needs compute capability >= 8.0); use precision=fp16")
