"""Base class of the strategy plugins and the single-process strategy.

A strategy owns everything that depends on the process topology: the device, the process group, the
order in which parallelisms are applied to the model, the forward/backward over micro-batches and the
reductions of losses and gradient norms. The loop only ever sees a list of model parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from omegaconf import DictConfig

from trainer.plugins.activation_checkpointing import ActivationCheckpointing
from trainer.plugins.precision import Precision
from trainer.loss import cross_entropy_loss
from trainer.optim import optimizer_from_config

MicroBatch = tuple[torch.Tensor, torch.Tensor]


def resolve_device(accelerator: str, local_rank: int = 0) -> torch.device:
    """`auto` picks CUDA when present, else the CPU."""
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.accelerator=cuda but no CUDA device is visible; use auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def compile_blocks(model: nn.Module) -> None:
    """Compile each transformer block in place.

    Per-block compilation keeps graphs small (fast to compile, reused across identical blocks) and keeps
    parameter names unchanged, which checkpoints and FSDP rely on.
    """
    for block in model.layers.values():  # type: ignore[union-attr]
        block.compile()


class Strategy:
    """Single-process defaults; distributed strategies override the topology-dependent hooks."""

    name: str = "single"
    # Which of the top-level shortcuts (dp, tp, pp) this strategy can use.
    uses_dp: bool = False
    uses_tp: bool = False
    uses_pp: bool = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0

    # ---- topology -----------------------------------------------------------------------------------
    def setup_environment(self, accelerator: str, num_threads: int | None, dp: int | str = 1, tp: int = 1,
                          pp: int = 1) -> None:
        """Pick the device and the intra-op thread count; distributed subclasses also join the process
        group and build the mesh from the parallel sizes (ignored here: everything is 1)."""
        del dp, tp, pp
        if num_threads:
            torch.set_num_threads(num_threads)
        self.device = resolve_device(accelerator, self.local_rank)

    def check_device(self, device_type: str) -> None:
        """Raise ValueError when an option cannot work on this device type (checked before launch)."""

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    # ---- model --------------------------------------------------------------------------------------
    def setup_model(
        self,
        model: nn.Module,
        activation_checkpointing: ActivationCheckpointing,
        precision: Precision,
        compile: bool,
    ) -> list[nn.Module]:
        """Turn a meta-device model into the trained model parts.

        The order is the same for every strategy: tensor parallel -> activation checkpointing ->
        compile -> data-parallel wrapping, then weights are materialized and initialized (here, with no
        sharding, materializing first is equivalent and simpler).
        """
        precision.setup(self.device)
        activation_checkpointing.apply(model)
        if compile:
            compile_blocks(model)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()  # type: ignore[operator]
        model.to(dtype=precision.param_dtype)
        return [model]

    def build_optimizer(self, optimizer_cfg: DictConfig, model_parts: Sequence[nn.Module]) -> torch.optim.Optimizer:
        """The configured optimizer over the model parts (ZeRO-1 wraps it to shard its states)."""
        return optimizer_from_config(optimizer_cfg, model_parts)

    def full_state_dict(self, model_parts: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """The unsharded, unwrapped model weights on CPU (every rank takes part; use rank 0's)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        merged: dict[str, torch.Tensor] = {}
        for part in model_parts:
            merged.update(get_model_state_dict(part, options=options))
        return merged

    # ---- step ---------------------------------------------------------------------------------------
    def forward_backward(
        self,
        model_parts: Sequence[nn.Module],
        microbatches: Sequence[MicroBatch],
        precision: Precision,
        on_before_backward: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; return the mean loss of this rank (detached)."""
        (model,) = model_parts
        total = torch.zeros((), device=self.device)
        for inputs, targets in microbatches:
            total += self.microbatch_backward(model, inputs, targets, len(microbatches), precision,
                                              on_before_backward)
        return total

    def microbatch_backward(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                            num_microbatches: int, precision: Precision,
                            on_before_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Forward and backward of one micro-batch, its loss divided by the number of micro-batches
        so that the accumulated gradient is the gradient of the mean loss (they hold equal token
        counts). Returns that divided loss, detached."""
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        with precision.autocast():
            logits = model(inputs)
        loss = cross_entropy_loss(logits, targets) / num_microbatches
        if on_before_backward is not None:
            on_before_backward(loss)
        precision.scale_loss(loss).backward()
        return loss.detach()

    @torch.no_grad()
    def evaluate(
        self, model_parts: Sequence[nn.Module], batches: Sequence[MicroBatch], precision: Precision
    ) -> float:
        """Mean loss over the validation batches (each rank evaluates its slice)."""
        (model,) = model_parts
        model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            with precision.autocast():
                logits = model(inputs.to(self.device))
            total += cross_entropy_loss(logits, targets.to(self.device))
        model.train()
        return self.reduce_mean(total / len(batches)).item()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> bool:
        """Step the optimizer (through the precision plugin, which may skip); True if it stepped."""
        return precision.optimizer_step(optimizer)

    def zero_grad(self, model_parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        for part in model_parts:  # an optimizer over views of the parameters does not own their .grad
            part.zero_grad(set_to_none=True)

    def clip_grad_norm(self, model_parts: Sequence[nn.Module], max_norm: float) -> torch.Tensor:
        """Global gradient norm over every parameter; clip to max_norm when max_norm > 0."""
        params = [p for part in model_parts for p in part.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    # ---- collectives (identity with one process) ------------------------------------------------------
    def reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass


class SingleDevice(Strategy):
    """One process, one device: the reference every other strategy is checked against."""


@dataclass
class SingleDeviceConfig:
    """Schema of `strategy=single`."""

    _target_: str = "trainer.plugins.strategies.SingleDevice"
