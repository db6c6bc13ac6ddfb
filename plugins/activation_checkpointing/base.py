"""Base class of the activation-checkpointing policies."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


class ActivationCheckpointing:
    """A policy decides, block by block, what the forward keeps for the backward.

    `wrap_block` receives each transformer block with its index and returns the module to put in its
    place. The default keeps every activation (no recomputation).
    """

    name: str = "none"

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del layer_index, num_layers
        return block

    def apply(self, model: nn.Module) -> None:
        """Replace the blocks in `model.layers` (an nn.ModuleDict, so stage names survive)."""
        layers = getattr(model, "layers", None)
        if layers is None:
            return
        num_layers = len(layers)
        for index, (name, block) in enumerate(list(layers.items())):
            layers[name] = self.wrap_block(block, index, num_layers)


class NoCheckpointing(ActivationCheckpointing):
    """Keep every activation: fastest, most memory."""


@dataclass
class NoCheckpointingConfig:
    """Schema of `activation_checkpointing=none`."""

    _target_: str = "plugins.activation_checkpointing.NoCheckpointing"
