"""Activation-checkpointing policies, applied per transformer block before data-parallel wrapping."""

from plugins.activation_checkpointing.base import (
    ActivationCheckpointing,
    NoCheckpointing,
    NoCheckpointingConfig,
)

__all__ = ["ActivationCheckpointing", "NoCheckpointing", "NoCheckpointingConfig"]
