"""Checkpoints of the whole training state: sharded DCP saves, atomic commits, resharding loads.

    save_checkpoint(trainer, path)          # collective; atomic (a `.partial` directory renamed when done)
    load_checkpoint(trainer, path)          # collective; reshards onto this run's strategy and world size
    latest_complete_checkpoint(directory)   # Path | None

`trainer.checkpoint.resuming.resume` applies the `resume` / `init_from` options; `trainer.checkpoint.hf`
converts to and from the Hugging Face Llama format. The CheckpointManager callback
(plugins/callbacks/checkpoint.py) decides when to save and which checkpoints to keep.
"""

from trainer.checkpoint.io import PendingCheckpoint, load_checkpoint, save_checkpoint
from trainer.checkpoint.manifest import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNoSpaceError,
    RetentionPolicy,
    complete_checkpoints,
    latest_complete_checkpoint,
    step_dirname,
)
from trainer.checkpoint.resuming import checkpoint_directory, resume

__all__ = [
    "save_checkpoint", "load_checkpoint", "latest_complete_checkpoint", "complete_checkpoints",
    "CheckpointError", "CheckpointCorruptError", "CheckpointNoSpaceError", "PendingCheckpoint", "RetentionPolicy", "step_dirname",
    "checkpoint_directory", "resume",
]
