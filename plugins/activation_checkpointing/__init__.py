"""Activation-checkpointing policies, applied per transformer block before data-parallel wrapping."""

from trainer.interfaces.activation_checkpointing import ActivationCheckpointing
from trainer.plugins.activation_checkpointing.none import NoCheckpointing, NoCheckpointingConfig
from trainer.plugins.activation_checkpointing.offload import ActivationOffloading, ActivationOffloadingConfig
from trainer.plugins.activation_checkpointing.recompute import (
    SELECTIVE_SAVE_OPS,
    AttentionCheckpointing,
    AttentionCheckpointingConfig,
    EveryNthCheckpointing,
    EveryNthCheckpointingConfig,
    FullCheckpointing,
    FullCheckpointingConfig,
    SelectiveCheckpointing,
    SelectiveCheckpointingConfig,
)

# Schema of each policy, registered in Hydra's ConfigStore as `<name>_schema` (conf/activation_checkpointing/
# *.yaml names it in its defaults list).
ACTIVATION_CHECKPOINTING_SCHEMAS: dict[str, type] = {
    "none": NoCheckpointingConfig,
    "full": FullCheckpointingConfig,
    "every_n": EveryNthCheckpointingConfig,
    "selective": SelectiveCheckpointingConfig,
    "attention": AttentionCheckpointingConfig,
    "offload": ActivationOffloadingConfig,
}
SCHEMAS = ACTIVATION_CHECKPOINTING_SCHEMAS  # the name every config family exports (trainer.config.registry)

__all__ = [
    "ActivationCheckpointing", "NoCheckpointing", "NoCheckpointingConfig",
    "FullCheckpointing", "FullCheckpointingConfig", "EveryNthCheckpointing", "EveryNthCheckpointingConfig",
    "SelectiveCheckpointing", "SelectiveCheckpointingConfig", "AttentionCheckpointing",
    "AttentionCheckpointingConfig", "ActivationOffloading", "ActivationOffloadingConfig",
    "ACTIVATION_CHECKPOINTING_SCHEMAS", "SCHEMAS", "SELECTIVE_SAVE_OPS",
]
