"""`offload`: the activations a block saves for the backward are kept in host memory.

Nothing is recomputed: each activation the autograd graph saves inside a block is copied to (pinned)
CPU memory in the forward and copied back when the backward needs it (torch's
`torch.autograd.graph.save_on_cpu` hooks), trading device memory for PCIe traffic. Parameters (every
matmul saves its weight, or a transposed view of it) and other leaf tensors such as a pipeline stage's
received input stay where they are: something else keeps them on the device anyway, so a copy would
only add traffic. On a CPU device the activations already live in host memory, so the policy says so
once and runs the blocks unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing

log = logging.getLogger("trainer")


class SaveActivationsOnHost(saved_tensors_hooks):
    """torch's `save_on_cpu` hooks for activations; leaf tensors (parameters, inputs) and their views are
    saved as they are."""

    def __init__(self, pin_memory: bool, device_type: str) -> None:
        offload = save_on_cpu(pin_memory=pin_memory, device_type=device_type)

        def pack(tensor: torch.Tensor) -> tuple[bool, Any]:
            root = tensor._base if tensor._base is not None else tensor
            if root.is_leaf and root.requires_grad:
                return False, tensor
            return True, offload.pack_hook(tensor)

        def unpack(packed: tuple[bool, Any]) -> torch.Tensor:
            offloaded, value = packed
            return offload.unpack_hook(value) if offloaded else value

        super().__init__(pack, unpack)


def _input_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


class OffloadedBlock(ActivationWrapper):
    """Runs the wrapped block with its saved tensors offloaded to host memory.

    An `ActivationWrapper` like torch's checkpoint and offload wrappers: parameter names and state-dict
    keys stay those of the wrapped block, and missing attributes are looked up on it.
    """

    def __init__(self, block: nn.Module, pin_memory: bool, on_host_device: Callable[[], None]) -> None:
        super().__init__(block)
        self.pin_memory = pin_memory
        self._on_host_device = on_host_device

    # Not traced by torch.compile (recursive=False: the block it calls still is): the saved-tensor hooks
    # must be installed around the compiled block at run time, where they also see what the compiled
    # graph saves.
    @torch.compiler.disable(recursive=False)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = _input_device(args, kwargs)
        if device is None or device.type == "cpu":
            self._on_host_device()
            return self._checkpoint_wrapped_module(*args, **kwargs)
        with SaveActivationsOnHost(pin_memory=self.pin_memory, device_type=device.type):
            return self._checkpoint_wrapped_module(*args, **kwargs)


class ActivationOffloading(ActivationCheckpointing):
    """Keep every block's saved activations in CPU memory (meaningful with an accelerator)."""

    name = "offload"

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory
        self._noted = False

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del layer_index, num_layers
        return OffloadedBlock(block, self.pin_memory, self._note_host_device)

    def _note_host_device(self) -> None:
        if not self._noted and rank_zero_only.rank == 0:  # type: ignore[attr-defined]
            log.warning("activation_checkpointing=offload: the activations already live in CPU memory on this "
                        "device; offloading changes nothing here and is skipped")
        self._noted = True


@dataclass
class ActivationOffloadingConfig:
    """Schema of `activation_checkpointing=offload`."""

    _target_: str = "trainer.plugins.activation_checkpointing.ActivationOffloading"
    # Copy into page-locked host memory, so that device-to-host copies can overlap compute (GPU only).
    pin_memory: bool = True
