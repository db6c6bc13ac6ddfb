"""The CheckpointManager callback: when to save, which checkpoints to keep, saving on preemption.

Add it with `callbacks=[default,checkpoint]`. Saves go to `<run_dir>/checkpoints/step_<N>/` (see
trainer/checkpoint); `resume=auto` (the default) continues from the latest complete one.

Policies (any combination): every N steps, every T minutes, at the end of training; keep the last K,
the best K by a logged metric, and every checkpoint at a multiple of M steps (milestones). Preemption
signals are the loop's (trainer/preemption.py, `trainer.preemption_signals`), whatever the callbacks are:
it calls `save_for_preemption`, so the preemption checkpoint is one of this manager's (its directory, its
retention). An exception saves what the run had reached when every rank fails together (single process,
or all ranks meeting within `exception_timeout_s`).

In-memory snapshots (`in_memory_every`, trainer/checkpoint/memory.py): every N steps each rank writes its
shard into host shared memory and a replica of it onto its peer; a job restarted by the elastic agent
resumes from the newest one without reading the disk. They are removed at the end of the run.

Every decision is agreed across ranks (one small all-reduce per step when a save timer is set or an
asynchronous save is in flight), since a save is collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from trainer import recovery
from trainer.callback import CheckpointProvider
from trainer.checkpoint.io import PendingCheckpoint, save_checkpoint
from trainer.checkpoint.memory import remove_snapshots, save_snapshot, snapshot_root
from trainer.checkpoint.manifest import (
    CheckpointError,
    RetentionPolicy,
    checkpoint_step,
    complete_checkpoints,
    remove_partial_saves,
    step_dirname,
    update_metrics,
)

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")
MODES = ("min", "max")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class CheckpointManager(CheckpointProvider):
    """Saves the whole training state on a schedule, on preemption and on failure; prunes old saves.

    `directory` is where checkpoints go (relative paths are under the run directory). As the run's
    `CheckpointProvider` it tells resume where they are and gives the latest complete one to the
    callbacks that roll back to it (`latest_checkpoint`, collective).
    """

    def __init__(self, directory: str = "checkpoints", every_n_steps: Optional[int] = None,
                 every_n_minutes: Optional[float] = None, save_last: bool = True, keep_last: int = 3,
                 keep_best: int = 0, monitor: str = "val_loss", mode: str = "min",
                 milestone_every: Optional[int] = None, save_on_exception: bool = True,
                 exception_timeout_s: float = 10.0, async_save: bool = False,
                 in_memory_every: Optional[int] = None) -> None:
        self.check(every_n_steps=every_n_steps, every_n_minutes=every_n_minutes, keep_last=keep_last,
                   keep_best=keep_best, mode=mode, milestone_every=milestone_every,
                   exception_timeout_s=exception_timeout_s, in_memory_every=in_memory_every)
        self._configured_directory = directory
        self.directory: Optional[Path] = None
        self.every_n_steps = every_n_steps
        self.every_n_minutes = every_n_minutes
        self.save_last = save_last
        self.retention = RetentionPolicy(keep_last=keep_last, keep_best=keep_best, monitor=monitor, mode=mode,
                                         milestone_every=milestone_every)
        self.save_on_exception = save_on_exception
        self.exception_timeout_s = exception_timeout_s
        self.async_save = async_save
        self.in_memory_every = in_memory_every
        # seconds each in-memory snapshot held the loop up (this rank's)
        self.snapshot_stalls: list[float] = []
        self._snapshot_group: Any = None
        self.last_saved_step: Optional[int] = None
        self._trainer: Optional["Trainer"] = None
        self._pending: Optional[PendingCheckpoint] = None
        self._async_group: Any = None
        self._agreement_group: Any = None
        self._last_save_time = time.monotonic()
        self._saving = False

    # ---- configuration ------------------------------------------------------------------------------
    @staticmethod
    def check(*, every_n_steps: Optional[int], every_n_minutes: Optional[float], keep_last: int, keep_best: int,
              mode: str, milestone_every: Optional[int], exception_timeout_s: float,
              in_memory_every: Optional[int] = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or null, got {every_n_steps}")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be positive or null, got {every_n_minutes}")
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the latest checkpoint is what a resume needs), got {keep_last}")
        if keep_best < 0:
            raise ValueError(f"keep_best must be >= 0, got {keep_best}")
        if mode not in MODES:
            raise ValueError(f"mode must be min or max, got {mode!r}")
        if milestone_every is not None and milestone_every < 1:
            raise ValueError(f"milestone_every must be >= 1 or null, got {milestone_every}")
        if exception_timeout_s < 0:
            raise ValueError(f"exception_timeout_s must be >= 0, got {exception_timeout_s}")
        if in_memory_every is not None and in_memory_every < 1:
            raise ValueError(f"in_memory_every must be >= 1 or null, got {in_memory_every}")

    @staticmethod
    def check_directory(directory: str) -> None:
        """An absolute `directory` must be creatable and writable (a relative one is under the run directory,
        which the CLI checks): a temporary directory is made and removed where it goes."""
        path = Path(directory).expanduser()
        if not path.is_absolute():
            return
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            raise ValueError(f"directory: {existing} is not a directory, cannot create {directory}")
        try:
            tempfile.TemporaryDirectory(dir=existing, prefix=".trainer-write-test-").cleanup()
        except OSError as error:
            raise ValueError(f"directory: cannot write checkpoints to {directory} "
                             f"({error.strerror or error} in {existing})") from None

    @classmethod
    def check_config(cls, node: Any) -> None:
        """Called by config validation before any process starts."""
        cls.check_directory(str(node.get("directory", "checkpoints")))
        cls.check(every_n_steps=node.get("every_n_steps"), every_n_minutes=node.get("every_n_minutes"),
                  keep_last=node.get("keep_last", 3), keep_best=node.get("keep_best", 0),
                  mode=node.get("mode", "min"), milestone_every=node.get("milestone_every"),
                  exception_timeout_s=node.get("exception_timeout_s", 10.0),
                  in_memory_every=node.get("in_memory_every"))

    def resolve_directory(self, run_dir: Path | str) -> Path:
        """The checkpoint directory of a run in `run_dir` (relative `directory` options are under it)."""
        directory = Path(self._configured_directory).expanduser()
        self.directory = directory if directory.is_absolute() else Path(run_dir) / directory
        return self.directory

    def snapshot_root(self, run_dir: Path | str) -> Optional[Path]:
        """Where the run's in-memory snapshots are (None without `in_memory_every`)."""
        return snapshot_root(run_dir) if self.in_memory_every is not None else None

    # ---- queries --------------------------------------------------------------------------------------
    def latest_checkpoint(self, trainer: "Trainer", before_step: Optional[int] = None) -> Optional[Path]:
        """The newest complete checkpoint (of a step below `before_step` when given), the same on every
        rank. Collective: an asynchronous save still in flight is finished first on every rank (its
        checkpoint may be the one asked for), then rank 0's listing is broadcast."""
        if self._pending is not None:
            self._finish_pending()
        found: Optional[str] = None
        if self.directory is not None:
            steps = [path for path in complete_checkpoints(self.directory)
                     if before_step is None or (checkpoint_step(path) or 0) < before_step]
            found = str(steps[-1]) if steps else None
        chosen = trainer.strategy.broadcast_object(found)
        return Path(chosen) if chosen is not None else None

    # ---- saving ---------------------------------------------------------------------------------------
    def save(self, trainer: "Trainer", reason: str, asynchronous: Optional[bool] = None) -> Path:
        """Save now (collective) and apply the retention policy; `asynchronous` overrides `async_save`."""
        assert self.directory is not None, "the manager saves once fit() has started"
        if self._pending is not None:
            self._finish_pending()
        path = self.directory / step_dirname(trainer.step)
        metrics = self._metrics(trainer)
        # Stays set if the save raises: the failure handler must not try to save again.
        self._saving = True
        result = save_checkpoint(trainer, path, reason=reason, metrics=metrics,
                                 asynchronous=self.async_save if asynchronous is None else asynchronous,
                                 process_group=self._async_group)
        self._saving = False
        self.last_saved_step = trainer.step
        self._last_save_time = time.monotonic()
        if isinstance(result, PendingCheckpoint):
            self._pending = result
        else:
            self._after_commit(trainer, path, reason)
        return path

    def _metrics(self, trainer: "Trainer") -> dict[str, float]:
        logged = trainer.logged_metrics
        if logged.get("step") != trainer.step:
            return {}
        return {key: float(value) for key, value in logged.items()
                if key != "step" and isinstance(value, (int, float))}

    def _after_commit(self, trainer: "Trainer", path: Path, reason: str) -> None:
        if not trainer.is_global_zero:
            return
        log.info(f"checkpoint saved: {path} ({reason})")
        for deleted in self.retention.apply(self.directory):  # type: ignore[arg-type]
            log.info(f"checkpoint removed by the retention policy: {deleted}")

    def _finish_pending(self) -> None:
        """Wait for the in-flight asynchronous save on every rank (collective)."""
        pending, self._pending = self._pending, None
        assert pending is not None and self._trainer is not None
        error: Optional[BaseException] = None
        try:
            with self._trainer.untimed():  # waiting for a checkpoint is not training time
                pending.wait()
        except CheckpointError as failure:
            error = failure
        failures = self._trainer.strategy.all_gather_object(None if error is None else str(error))
        if any(failures):
            raise CheckpointError(next(f for f in failures if f))
        self._after_commit(self._trainer, pending.path, "asynchronous")

    # ---- hooks ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: "Trainer") -> None:
        self._trainer = trainer
        directory = self.resolve_directory(trainer.run_dir)
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            for leftover in remove_partial_saves(directory):
                log.warning(f"removed an incomplete save (a process stopped while writing it): {leftover}")
        if _distributed():
            # Dedicated gloo groups, so that neither a background save nor the failure rendezvous shares
            # a communicator with the training collectives (new_group is collective: every rank is here).
            if self.async_save:
                self._async_group = dist.new_group(backend="gloo")
            if self.save_on_exception:
                self._agreement_group = dist.new_group(backend="gloo")
            if self.in_memory_every is not None:  # the snapshots' bytes travel over gloo whatever the training group
                self._snapshot_group = dist.new_group(backend="gloo")
        self.snapshot_stalls = []
        self._recording_progress = trainer.is_global_zero and recovery.under_restarting_agent()
        self._last_save_time = time.monotonic()
        self._saving = False
        trainer.strategy.barrier()

    def save_for_preemption(self, trainer: "Trainer") -> Path:
        """The loop's preemption save (trainer/preemption.py owns the signals): a synchronous save of this
        step into this manager's directory, under its retention; the one of this step when already saved."""
        if self._pending is not None:
            self._finish_pending()
        if self.last_saved_step == trainer.step and self.directory is not None:
            path = self.directory / step_dirname(trainer.step)
            if trainer.strategy.broadcast_object(path.is_dir()):
                trainer.flush_loggers()
                return path
        return self.save(trainer, "signal", asynchronous=False)

    def _agreed_flags(self) -> tuple[bool, bool]:
        """(a rank's save timer expired, every rank finished the save in flight), the same on every rank."""
        due = (self.every_n_minutes is not None
               and time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes)
        pending = self._pending is not None
        busy = pending and not self._pending.done()  # type: ignore[union-attr]
        flags = [due, busy]
        if _distributed() and (self.every_n_minutes is not None or pending):
            tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flags = [bool(v) for v in tensor.tolist()]
        return flags[0], pending and not flags[1]

    def on_train_batch_end(self, trainer: "Trainer", outputs: dict[str, Any]) -> None:
        if trainer.recovery is not None and "first_step_end" not in trainer.recovery:
            trainer.recovery = recovery.complete(trainer.recovery, time.time(), trainer.step)
            log.info(recovery.describe(trainer.recovery))
        if self._recording_progress:
            recovery.record_progress(trainer.run_dir, trainer.step)
        timed, written = self._agreed_flags()
        if written:
            self._finish_pending()
        periodic = self.every_n_steps is not None and trainer.step % self.every_n_steps == 0
        if periodic or timed:
            self.save(trainer, "periodic" if periodic else "timed")
        if self.in_memory_every is not None and trainer.step % self.in_memory_every == 0:
            self._snapshot(trainer)

    def _snapshot(self, trainer: "Trainer") -> None:
        root = snapshot_root(trainer.run_dir)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", trainer.strategy.world_size))
        stall = save_snapshot(trainer, root, self._snapshot_group, local_world)
        if trainer.is_global_zero and not self.snapshot_stalls:
            log.info(f"in-memory snapshots every {self.in_memory_every} steps in {root} (removed at the end of the "
                     f"run; a crashed job's: rm -rf {root}); step {trainer.step}'s took {stall:.2f} s")
        self.snapshot_stalls.append(stall)

    def on_validation_end(self, trainer: "Trainer") -> None:
        # Validation runs after the step's save: record its result in that checkpoint's manifest, so that
        # keep_best ranks checkpoints by the loss of their own weights.
        if self.last_saved_step != trainer.step or not trainer.is_global_zero or self.directory is None:
            return
        # The validation of a checkpoint's step is part of its record: on disk now, so a resume (which does
        # not validate that step again) finds it.
        trainer.flush_loggers()
        if self._pending is not None and not self._pending.done():
            return  # recorded when it commits: the manifest is written from the metrics at save time
        path = self.directory / step_dirname(trainer.step)
        metrics = {key: float(value) for key, value in trainer.logged_metrics.items()
                   if key.startswith("val_") and isinstance(value, (int, float))}
        if metrics and path.is_dir():
            update_metrics(path, metrics)
            self.retention.apply(self.directory)

    def on_fit_end(self, trainer: "Trainer") -> None:
        if self.save_last and self.last_saved_step != trainer.step:
            self.save(trainer, "end", asynchronous=False)
        if self._pending is not None:
            self._finish_pending()
        if self.in_memory_every is not None:
            # the run ended normally: its state is on disk (save_last) or the user chose not to keep it
            remove_snapshots(snapshot_root(trainer.run_dir), trainer.strategy.rank)
            if self.snapshot_stalls and trainer.is_global_zero:
                stalls = sorted(self.snapshot_stalls)
                log.info(f"in-memory snapshots: {len(stalls)}, median stall {stalls[len(stalls) // 2]:.3f} s "
                         f"(rank 0)")

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        self._pending = None
        if (not self.save_on_exception or self._saving or isinstance(exception, (CheckpointError, KeyboardInterrupt))
                or self.directory is None or self.last_saved_step == trainer.step):
            return
        if _distributed() and trainer.preemption.received is not None:
            return  # being shut down (the launcher stops the other workers when one fails): leave quickly
        if _distributed() and not self._all_ranks_failed(trainer):
            if trainer.is_global_zero:
                log.warning("not saving after the failure: the other ranks did not fail with this one")
            return
        try:
            path = self.save(trainer, "exception", asynchronous=False)
        except Exception as error:  # noqa: BLE001 - the original exception is what the run reports
            if trainer.is_global_zero:
                log.error(f"could not save a checkpoint after the failure: {error}")
            return
        if trainer.is_global_zero:
            log.warning(f"saved the state at step {trainer.step} after the failure: {path}")

    def _all_ranks_failed(self, trainer: "Trainer") -> bool:
        """Whether every rank reaches this point within the timeout (then they can save together)."""
        if self._agreement_group is None or self.exception_timeout_s <= 0:
            return False
        try:
            dist.monitored_barrier(group=self._agreement_group, wait_all_ranks=True,
                                   timeout=datetime.timedelta(seconds=self.exception_timeout_s))
        except RuntimeError:
            return False
        return True


@dataclass
class CheckpointManagerConfig:
    """Schema of `callbacks=[...,checkpoint]` (`callbacks.checkpoint.*`)."""

    _target_: str = "trainer.plugins.callbacks.CheckpointManager"
    # Where checkpoints go; a relative path is under the run directory.
    directory: str = "checkpoints"
    # Save every N optimizer steps (null: no step-based saves).
    every_n_steps: Optional[int] = None
    # Save when this many minutes passed since the last save (null: no time-based saves).
    every_n_minutes: Optional[float] = None
    # Save at the end of training.
    save_last: bool = True
    # Keep the K most recent checkpoints (>= 1).
    keep_last: int = 3
    # Also keep the K best by `monitor` (0: none); validation metrics are recorded in each manifest.
    keep_best: int = 0
    # Metric ranking the best checkpoints (a logged key: val_loss, train_loss...) and its direction.
    monitor: str = "val_loss"
    mode: str = "min"
    # Never delete checkpoints at steps that are multiples of this (null: no milestones).
    milestone_every: Optional[int] = None
    # On an exception: save when every rank fails together (single process: always).
    save_on_exception: bool = True
    # Multi-process runs: how long a failing rank waits for the others before giving up on saving.
    exception_timeout_s: float = 10.0
    # Write checkpoints in a background thread (host copy first; the run continues while it writes).
    async_save: bool = False
    # Snapshot the whole state into host shared memory every N steps, each rank's shard replicated on a
    # peer rank (another node when there are several); a restarted job resumes from it without reading
    # the disk when it is at least as new as the newest checkpoint (null: no snapshots).
    in_memory_every: Optional[int] = None
