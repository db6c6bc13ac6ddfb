"""The activation-checkpointing interface: a policy that rewrites transformer blocks before compile and
data-parallel wrapping (implementations in trainer/plugins/activation_checkpointing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from trainer.interfaces.strategy import Strategy


class ActivationCheckpointing:
    """A policy decides, block by block, what the forward keeps for the backward.

    `wrap_block` receives each transformer block with its global layer index and the model's number of
    layers, and returns the module to put in its place. The default keeps every activation (no
    recomputation). Strategies call `apply` on each model part after tensor parallelism and before
    compile and data-parallel wrapping.
    """

    name: str = "none"

    @property
    def checkpoint_every_n(self) -> int:
        """Every how many blocks the policy acts (the planner's activation-memory model reads it)."""
        return 1

    def wrap_block(self, block: nn.Module, layer_index: int, num_layers: int) -> nn.Module:
        del layer_index, num_layers
        return block

    def check_model(self, num_layers: int) -> None:
        """Raise ValueError when the policy cannot do what it promises on a model of `num_layers` blocks
        (called by config validation, before any process starts)."""
        del num_layers

    def check_strategy(self, strategy: "Strategy", ep: int = 1) -> None:
        """Raise ValueError, naming both, when the (instantiated, not yet set up) strategy cannot run this
        policy with `ep`-way expert parallelism (called by config validation)."""
        del strategy, ep

    def apply(self, model: nn.Module) -> None:
        """Replace the model's blocks (its family's checkpointing units; a pipeline stage's own)."""
        from trainer.models import family_of  # the families import this package's model_family: not at load

        family = family_of(model)
        blocks = family.blocks(model)
        num_layers = family.num_layers(model)
        for position, (name, block) in enumerate(list(blocks.items())):
            # The keys are global layer indices (a pipeline stage keeps them), so a stage picks the same
            # blocks as the whole model would: every_n gives the same recomputation under any split.
            index = int(name) if name.isdigit() else position
            family.set_block(model, name, self.wrap_block(block, index, num_layers))
