"""`activation_checkpointing=none`: keep every activation."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing


class NoCheckpointing(ActivationCheckpointing):
    """Keep every activation: fastest, most memory."""


@dataclass
class NoCheckpointingConfig:
    """Schema of `activation_checkpointing=none`."""

    _target_: str = "trainer.plugins.activation_checkpointing.NoCheckpointing"
