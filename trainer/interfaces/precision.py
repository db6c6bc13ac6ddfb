"""The precision interface: what the strategy asks of a number format.

Every hook is the identity for full fp32 training, so a plugin (trainer/plugins/precision) overrides only
what its number format changes (autocast region, parameter dtype, loss scaling, the optimizer step that
may be skipped on overflow, FSDP's mixed-precision policy). The strategy owns its precision plugin
(`Strategy.precision`): the loop never calls one directly.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer.offload import HostSteppedCopies
from trainer.optim import SteppedCopies

if TYPE_CHECKING:
    from trainer.interfaces.strategy import Strategy

# Names of the dtypes in configs and messages.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_from_name(name: str, key: str, allowed: tuple[str, ...] = tuple(DTYPES)) -> torch.dtype:
    """`fp32`/`bf16`/`fp16` (among `allowed`) -> torch dtype; ValueError naming the config key otherwise."""
    if name not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {name!r}")
    return DTYPES[name]


class Precision:
    """Identity precision: parameters, activations, gradients and optimizer states in fp32."""

    name: str = "fp32"
    # dtype the parameters are stored in; the strategy casts the model to it before wrapping.
    param_dtype: torch.dtype = torch.float32
    # dtype the matmuls run in (the MFU reference peak depends on it).
    compute_dtype: torch.dtype = torch.float32
    # dtype data-parallel gradient reductions should use (None: the gradients' own dtype).
    reduce_dtype: torch.dtype | None = None
    # Whether the optimizer steps fp32 copies of lower-precision parameters (bf16_true); the planner and
    # the state report count those copies.
    master_weights: bool = False
    # Whether the plugin itself skips the steps whose gradients are not finite (a dynamic loss scaler
    # treats them as routine: it lowers the scale), so callbacks do not count them as failures.
    skips_nonfinite_steps: bool = False

    def __init__(self) -> None:
        # Set by the strategy once it knows the device (autocast needs the device type).
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        # What the optimizer steps in place of the strategy's tensors, if anything (`setup_optimizer`).
        self.copies: SteppedCopies | None = None

    def setup(self, device: torch.device) -> None:
        """Called by the strategy before the model is built on `device`."""
        self.device_type = device.type

    def convert_model(self, model: nn.Module, gathered_parameters: bool = False) -> None:
        """Called by the strategy on the whole meta-device model before anything parallelizes it: swap
        modules for the number format's own (fp8: float8 linear layers). `gathered_parameters`: FSDP2
        will shard the parameters and all-gather them per block (`Strategy.gathers_parameters`)."""

    def tensor_parallel_problem(self) -> str | None:
        """Why the model this precision converts cannot be split by tensor parallelism (None: it can);
        validation refuses tp > 1 with this reason."""
        return None

    def check_strategy(self, strategy: "Strategy", device_type: str) -> None:
        """Raise ValueError (one line naming both) when `strategy` on `device_type` cannot honour this
        precision. Called by config validation before any process starts; the rules ask the strategy
        through its interface (`Strategy.check_reduce_dtype`) rather than by its class."""
        label = f"precision={self.name}"
        if self.reduce_dtype is not None and self.reduce_dtype != self.param_dtype:
            try:
                strategy.check_reduce_dtype(self.param_dtype, self.reduce_dtype)
            except ValueError as error:
                raise ValueError(f"{label} with precision.reduce_dtype={DTYPE_NAMES[self.reduce_dtype]}: "
                                 f"{strategy.label} {error}") from None
        if device_type == "cuda" and self.compute_dtype == torch.bfloat16 and torch.cuda.is_available() \
                and not torch.cuda.is_bf16_supported():
            raise ValueError(f"{label}: this GPU ({torch.cuda.get_device_name()}) has no bf16 support "
                             "(it needs compute capability >= 8.0); use precision=fp16")

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, host: torch.device | None = None) -> None:
        """Called once by the strategy when the run is assembled, before anything steps or loads the
        optimizer. The optimizer is made to step copies of its tensors when this precision keeps fp32
        master weights of lower-precision parameters (bf16_true), or when the strategy offloads the
        optimizer to `host` memory (ZeRO-Offload: states, masters and the step all live there)."""
        master = self.master_weights and self.param_dtype != torch.float32
        if self.copies is not None:
            return
        if host is not None:
            self.copies = HostSteppedCopies(optimizer, torch.float32 if master else None)
        elif master:
            self.copies = SteppedCopies(optimizer, torch.float32)

    def weights_written(self) -> None:
        """The strategy's tensors were written from outside the optimizer (a checkpoint or init_from
        loaded weights): copies the optimizer steps in their place are checked against them at the next
        step, and restart from them where they differ."""
        if self.copies is not None:
            self.copies.weights_written()

    def optimizer_tensor_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor the strategy gave the optimizer, the copy the optimizer steps in its place) pairs, so
        that a checkpoint can name the copy's optimizer states after the parameter."""
        return list(self.copies.pairs) if self.copies is not None else []

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer update, through the stepped copies when there are any."""
        if self.copies is not None:
            self.copies.step(optimizer)
        else:
            optimizer.step()

    def autocast(self) -> ContextManager[Any]:
        """Context entered around every forward pass."""
        return contextlib.nullcontext()

    def fsdp_mixed_precision(self) -> MixedPrecisionPolicy:
        """FSDP2's policy under the sharded strategies (zero2, zero3, fsdp, 3d): what the gathered
        parameters are cast to and what gradients are reduced in."""
        return MixedPrecisionPolicy()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Loss actually back-propagated (a loss scaler multiplies it)."""
        return loss

    def unscale_gradients(self, optimizer: torch.optim.Optimizer, model_parts: Sequence[nn.Module] = ()) -> None:
        """Called once per step before gradient clipping, so that norms are measured in true units.

        `model_parts` are the modules whose parameters hold the gradients (the optimizer may step other
        tensors, e.g. ZeRO-1's sharded views, whose gradients are only attached at the step).
        """

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Take the step; return False when it was skipped (e.g. on fp16 overflow)."""
        self.step(optimizer)
        return True

    def metrics(self) -> dict[str, float]:
        """Values logged with every training step (e.g. the loss scale)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this plugin (loss scale, master weights)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def gradients(optimizer: torch.optim.Optimizer, model_parts: Sequence[nn.Module]) -> Iterator[torch.Tensor]:
    """Every gradient once: of the model parts' parameters, else of the optimizer's tensors."""
    seen: set[int] = set()
    if model_parts:
        params: Iterator[torch.Tensor] = (p for part in model_parts for p in part.parameters())
    else:
        params = (p for group in optimizer.param_groups for p in group["params"])
    for param in params:
        if param.grad is not None and id(param) not in seen:
            seen.add(id(param))
            yield param.grad
