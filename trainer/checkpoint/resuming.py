"""Where a run starts: `resume` (auto | none | PATH) and `init_from` (weights only).

- `resume=auto` (the default): the latest complete checkpoint of the run's checkpoint directory
  (the CheckpointManager's, `<run_dir>/checkpoints` by default); a fresh start when there is none. A
  damaged checkpoint is reported and the previous complete one is tried instead.
- `resume=PATH`: that checkpoint, or the latest complete one in that directory of checkpoints.
- `resume=none`: never resume.
- `init_from=PATH`: start a new run (step 0, fresh optimizer) from the weights of a checkpoint or of a
  Hugging Face Llama model directory; ignored when the run resumes from its own checkpoint.

A worker restarted by the elastic agent (`trainer.max_restarts`) always resumes from the run's own
latest checkpoint when there is one, whatever `resume` says: that is the state the job had reached.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

from trainer.callback import CheckpointProvider, Providers
from trainer.checkpoint.hf import is_hf_model, load_hf_weights
from trainer.checkpoint.io import load_checkpoint
from trainer.checkpoint.manifest import (
    CheckpointCorruptError,
    CheckpointError,
    checkpoint_step,
    complete_checkpoints,
    is_checkpoint,
)
from trainer.checkpoint.memory import restore_snapshot
from trainer.recovery import fault_timeline

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")
DEFAULT_DIRECTORY = "checkpoints"


def checkpoint_directory(trainer: "Trainer") -> Path:
    """The run's checkpoint directory: its CheckpointProvider's (the first, should there be several),
    else `<run_dir>/checkpoints`."""
    providers = Providers(trainer.callbacks).all(CheckpointProvider)
    if providers:
        return Path(providers[0].resolve_directory(trainer.run_dir))
    return Path(trainer.run_dir) / DEFAULT_DIRECTORY


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _candidates(trainer: "Trainer", source: str) -> tuple[list[Path], bool]:
    """Checkpoints to try, newest first, and whether falling back to an older one is allowed."""
    own = complete_checkpoints(checkpoint_directory(trainer))
    if source == "auto" or (restart_count() > 0 and own):
        return own[::-1], True
    target = Path(source).expanduser()
    if is_checkpoint(target):
        return [target], False
    found = complete_checkpoints(target)
    if not found:
        raise CheckpointError(f"resume={source}: no complete checkpoint there")
    return found[::-1], True


def resume(trainer: "Trainer", source: str = "auto", init_from: Optional[str] = None) -> Optional[Path]:
    """Restore the state the run starts from (collective): `source` is the `resume` option (auto, none or
    a path). Returns the checkpoint resumed, or None for a new run."""
    start = time.time()
    resumed = _resume(trainer, source, init_from)
    if restart_count() > 0 and trainer.is_global_zero:
        label = str(resumed) if resumed is not None else "nothing (step 0)"
        trainer.recovery = fault_timeline(trainer.run_dir, trainer.step, label, start, time.time() - start)
    return resumed


def _resume(trainer: "Trainer", source: str, init_from: Optional[str]) -> Optional[Path]:
    if source != "none":
        candidates, fallback = _candidates(trainer, source)
        # Every rank must try the same checkpoints in the same order: rank 0's listing decides.
        candidates = [Path(p) for p in trainer.strategy.all_gather_object([str(p) for p in candidates])[0]]
        if fallback:  # resume=auto, or a restarted worker: the run's own state, the newer of memory and disk
            snapshot = _resume_from_memory(trainer, checkpoint_step(candidates[0]) if candidates else None)
            if snapshot is not None:
                return snapshot
        damaged = []
        for path in candidates:
            try:
                manifest = load_checkpoint(trainer, path)
            except CheckpointCorruptError as error:
                if not fallback:
                    raise
                damaged.append(str(error))
                if trainer.is_global_zero:
                    log.warning(f"{error}; falling back to the previous complete checkpoint")
                continue
            if trainer.is_global_zero:
                attempt = f" (restart {restart_count()})" if restart_count() else ""
                log.info(f"resumed from {path} at step {trainer.step}{attempt}; saved by "
                         f"{manifest.get('world_size')} rank(s) under strategy={manifest.get('strategy')}")
            return path
        if damaged:
            raise CheckpointError("no loadable checkpoint: " + " | ".join(damaged))
    if init_from:
        weights = Path(init_from).expanduser()
        if is_checkpoint(weights):
            load_checkpoint(trainer, weights, weights_only=True)
        elif is_hf_model(weights):
            load_hf_weights(trainer, weights)
            trainer.precision.weights_written()
        else:
            raise CheckpointError(f"init_from={init_from}: neither a checkpoint (checkpoint.json) nor a Hugging Face "
                                  "model directory (config.json + *.safetensors)")
        if trainer.is_global_zero:
            log.info(f"initialized the weights from {weights} (a new run: step 0, fresh optimizer)")
    return None


def _resume_from_memory(trainer: "Trainer", disk_step: Optional[int]) -> Optional[Path]:
    """Restore the newest in-memory snapshot (trainer/checkpoint/memory.py) when the run's checkpoint
    provider takes them and one is at least as new as the disk's (collective). Returns its directory."""
    providers = Providers(trainer.callbacks).all(CheckpointProvider)
    root = providers[0].snapshot_root(trainer.run_dir) if providers else None
    if root is None:
        return None
    start = time.perf_counter()
    distributed = dist.is_available() and dist.is_initialized() and trainer.strategy.world_size > 1
    # The bytes travel over a gloo group of their own (the training group may be NCCL).
    group = dist.new_group(backend="gloo") if distributed else None
    step = restore_snapshot(trainer, root, group, disk_step)
    if step is None:
        return None
    if trainer.is_global_zero:
        attempt = f" (restart {restart_count()})" if restart_count() else ""
        log.info(f"resumed from the in-memory snapshot of step {step} in {root}{attempt}, "
                 f"{time.perf_counter() - start:.2f} s, no disk read")
    return root
