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

Saves are asynchronous by default (`async_save`): background threads copy the state to host memory (the
loop goes on with the next step's forward and backward, and waits for the copy before its optimizer step)
and then write it; rank 0 commits it (manifest, rename) only after every rank's write, so a
crash during the write leaves an uncommitted `.partial` directory that resume never takes. Synchronous
(the loop waits for the write and the commit): the save at the end (`save_last`), on a preemption signal
and after an exception (the process is about to exit: the checkpoint must be committed before it does),
and every save when `async_save=false`. Each save logs one line with the time it held the loop up
(`stall`), and the end of fit puts every save's figures into summary.json (`checkpoints`).

Every decision is agreed across ranks (one small all-reduce per step when a save timer is set or an
asynchronous save is in flight), since a save is collective.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager

from trainer import recovery
from trainer.callback import CheckpointProvider
from trainer.checkpoint.io import PendingCheckpoint, background_stager, finish_checkpoint, save_checkpoint
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


@dataclass
class SaveRecord:
    """What one save cost the training loop, on rank 0's clock (the save is collective: the other ranks wait
    about as long)."""

    step: int
    reason: str
    asynchronous: bool
    # The save call: a synchronous save's whole write and commit; an asynchronous one's collection of the
    # state, space check, metrics flush and hand-over of the copy to host memory and the write to background
    # threads.
    call_s: float
    # Later waits of the loop for this save: for its copy to host memory before the next optimizer step, for
    # its write at the next save, `latest_checkpoint` or the end of fit (0 when they had ended by then).
    wait_s: float = 0.0
    # Asynchronous: from the hand-over to the end of the write on rank 0 and its commit (the loop trained
    # meanwhile).
    write_s: Optional[float] = None

    @property
    def stall_s(self) -> float:
        """Seconds the loop stood still for this save."""
        return self.call_s + self.wait_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "stall_s": self.stall_s}


def save_figures(records: list[SaveRecord], snapshot_stalls: list[float]) -> dict[str, Any]:
    """summary.json `checkpoints`: every save, and the median and largest stall per kind of save."""
    def kind(stalls: list[float], extra: dict[str, Any]) -> dict[str, Any]:
        if not stalls:
            return {"saves": 0}
        return {"saves": len(stalls), "median_stall_s": statistics.median(stalls), "max_stall_s": max(stalls), **extra}

    asynchronous = [r for r in records if r.asynchronous]
    writes = [r.write_s for r in asynchronous if r.write_s is not None]
    return {
        "saves": [record.as_dict() for record in records],
        "asynchronous": kind([r.stall_s for r in asynchronous],
                             {"median_write_s": statistics.median(writes)} if writes else {}),
        "synchronous": kind([r.stall_s for r in records if not r.asynchronous], {}),
        "in_memory": kind(snapshot_stalls, {}),
    }


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
                 exception_timeout_s: float = 10.0, async_save: bool = True,
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
        # what each disk save of this fit cost the loop (summary.json `checkpoints`)
        self.saves: list[SaveRecord] = []
        # validation metrics of a step whose asynchronous save had not committed yet: into its manifest at the commit
        self._late_metrics: dict[int, dict[str, float]] = {}
        self._snapshot_group: Any = None
        self.last_saved_step: Optional[int] = None
        self._trainer: Optional["Trainer"] = None
        self._pending: Optional[PendingCheckpoint] = None
        self._stager: Optional[DefaultStager] = None  # the asynchronous saves' (io.background_stager), for one fit
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
        """Save now (collective) and apply the retention policy; `asynchronous` overrides `async_save`.
        An asynchronous save is committed and pruned later (`_finish_pending`), a synchronous one before this
        returns."""
        assert self.directory is not None, "the manager saves once fit() has started"
        if self._pending is not None:
            self._finish_pending()
        asynchronous = self.async_save if asynchronous is None else asynchronous
        if asynchronous and dist.is_available() and dist.is_initialized() and self._async_group is None:
            # Without a group of its own the writing thread would issue collectives on the training group,
            # interleaved with the loop's: never (on_fit_start makes the group when async_save is set).
            asynchronous = False
        path = self.directory / step_dirname(trainer.step)
        metrics = self._metrics(trainer)
        start = time.perf_counter()
        # Stays set if the save raises: the failure handler must not try to save again.
        self._saving = True
        result = save_checkpoint(trainer, path, reason=reason, metrics=metrics, asynchronous=asynchronous,
                                 process_group=self._async_group, stager=self._stager if asynchronous else None)
        self._saving = False
        self.last_saved_step = trainer.step
        self._last_save_time = time.monotonic()
        if isinstance(result, PendingCheckpoint):
            self._pending = result
            self.saves.append(SaveRecord(trainer.step, reason, True, time.perf_counter() - start))
        else:
            record = SaveRecord(trainer.step, reason, False, 0.0)
            self.saves.append(record)
            self._after_commit(trainer, path, record, start)
        return path

    def _metrics(self, trainer: "Trainer") -> dict[str, float]:
        logged = trainer.logged_metrics
        if logged.get("step") != trainer.step:
            return {}
        return {key: float(value) for key, value in logged.items()
                if key != "step" and isinstance(value, (int, float))}

    def _after_commit(self, trainer: "Trainer", path: Path, record: SaveRecord, start: Optional[float] = None) -> None:
        """Rank 0, once the checkpoint is committed: validation metrics that came after an asynchronous save
        go into its manifest, the retention policy runs, one line says what the save cost. `start`: when the
        synchronous save call began (its stall ends after the pruning)."""
        late = self._late_metrics.pop(record.step, None)
        deleted: list[Path] = []
        if trainer.is_global_zero:
            if late and path.is_dir():
                update_metrics(path, late)
            deleted = self.retention.apply(self.directory)  # type: ignore[arg-type]
        if start is not None:
            record.call_s = time.perf_counter() - start
        if not trainer.is_global_zero:
            return
        if record.asynchronous:
            cost = (f"the loop stalled {record.stall_s:.2f} s ({record.call_s:.2f} s in the save call, {record.wait_s:.2f} s "
                    f"waiting for its copy to host memory and its write); written in the background in "
                    f"{record.write_s:.2f} s")
        else:
            cost = f"the loop stalled {record.stall_s:.2f} s"
        log.info(f"checkpoint saved: {path} ({record.reason}, {'asynchronous' if record.asynchronous else 'synchronous'}): "
                 f"{cost}")
        for path_deleted in deleted:
            log.info(f"checkpoint removed by the retention policy: {path_deleted}")

    def _finish_pending(self) -> None:
        """Wait for the in-flight asynchronous save on every rank and agree on its outcome (collective);
        the wait counts as that save's stall."""
        pending, self._pending = self._pending, None
        assert pending is not None and self._trainer is not None
        record = next(r for r in reversed(self.saves) if r.step == pending.step and r.asynchronous)
        start = time.perf_counter()
        try:
            finish_checkpoint(self._trainer, pending)
        finally:
            record.wait_s += time.perf_counter() - start
            record.write_s = pending.write_s
        self._after_commit(self._trainer, pending.path, record)

    # ---- hooks ----------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: "Trainer") -> None:
        self._trainer = trainer
        directory = self.resolve_directory(trainer.run_dir)
        if trainer.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            for leftover in remove_partial_saves(directory):
                log.warning(f"removed an incomplete save (a process stopped while writing it): {leftover}")
        if dist.is_available() and dist.is_initialized() and self.async_save:
            # A dedicated gloo group for the writing thread's collectives (DCP's plan and its completion), so
            # that they never interleave with the loop's on the training group, of any size (new_group is
            # collective: every rank is here).
            self._async_group = dist.new_group(backend="gloo")
        self._close_stager()
        if self.async_save:
            self._stager = background_stager(trainer.strategy.device.type)
        if _distributed():
            # The failure rendezvous and the snapshots' bytes get dedicated gloo groups too.
            if self.save_on_exception:
                self._agreement_group = dist.new_group(backend="gloo")
            if self.in_memory_every is not None:  # the snapshots' bytes travel over gloo whatever the training group
                self._snapshot_group = dist.new_group(backend="gloo")
        self.snapshot_stalls = []
        self.saves = []
        self._late_metrics = {}
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

    def on_before_optimizer_step(self, trainer: "Trainer", optimizer: torch.optim.Optimizer) -> None:
        """The step changes the parameters and the optimizer's state: an asynchronous save's copy of them to
        host memory, running in the background since the save, must be complete (the wait is that save's
        stall)."""
        pending = self._pending
        if pending is None or pending.staged():
            return
        record = next(r for r in reversed(self.saves) if r.step == pending.step and r.asynchronous)
        start = time.perf_counter()
        try:
            pending.wait_staged()
        finally:
            record.wait_s += time.perf_counter() - start

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
        path = self.directory / step_dirname(trainer.step)
        metrics = {key: float(value) for key, value in trainer.logged_metrics.items()
                   if key.startswith("val_") and isinstance(value, (int, float))}
        if self._pending is not None and self._pending.step == trainer.step:
            # not committed yet (perhaps it is, but until _finish_pending the commit belongs to the writing
            # thread): added to its manifest by _after_commit, before its retention pass
            self._late_metrics[trainer.step] = metrics
            return
        if metrics and path.is_dir():
            update_metrics(path, metrics)
            self.retention.apply(self.directory)

    def on_fit_end(self, trainer: "Trainer") -> None:
        if self.save_last and self.last_saved_step != trainer.step:
            self.save(trainer, "end", asynchronous=False)
        if self._pending is not None:
            self._finish_pending()
        self._close_stager()
        if self.in_memory_every is not None:
            # the run ended normally: its state is on disk (save_last) or the user chose not to keep it
            remove_snapshots(snapshot_root(trainer.run_dir), trainer.strategy.rank)
            if self.snapshot_stalls and trainer.is_global_zero:
                stalls = sorted(self.snapshot_stalls)
                log.info(f"in-memory snapshots: {len(stalls)}, median stall {stalls[len(stalls) // 2]:.3f} s "
                         f"(rank 0)")
        trainer.checkpoint_figures = save_figures(self.saves, self.snapshot_stalls)

    def _close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()  # its thread ends once a copy in progress has (the write keeps its tensors)
            self._stager = None

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        try:
            self._save_after_failure(trainer, exception)
        finally:
            self._close_stager()

    def _save_after_failure(self, trainer: "Trainer", exception: BaseException) -> None:
        pending, self._pending = self._pending, None
        shutting_down = _distributed() and trainer.preemption.received is not None
        if pending is not None and not isinstance(exception, KeyboardInterrupt) and not shutting_down:
            # Let a write in flight end (committed, or failed when a peer is gone) before the exception save
            # and the teardown; bounded, as a peer may hang. A timeout leaves it uncommitted, never half-committed.
            # (Not when the launcher is stopping the workers: they leave quickly, the write stays uncommitted.)
            try:
                pending.wait(timeout=None if not _distributed() else self.exception_timeout_s)
            except CheckpointError as error:
                if pending.step == self.last_saved_step:
                    self.last_saved_step = None  # not saved after all: the exception save below may write it
                if trainer.is_global_zero:
                    log.warning(f"the asynchronous save of step {pending.step} failed: {error}")
            except TimeoutError as error:
                # still writing into its .partial directory: no save of the same step may write there now
                if trainer.is_global_zero:
                    log.warning(f"{error}; it stays uncommitted")
            else:
                if trainer.is_global_zero:
                    log.info(f"checkpoint saved: {pending.path} (asynchronous, completed after the failure)")
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
    # Write periodic and timed checkpoints in a background thread: the state is copied to host memory (the
    # loop waits for that copy only), then written while training goes on, and committed by rank 0 once every
    # rank has written it. The end, preemption and exception saves are synchronous whatever this says.
    # Costs a second copy of this rank's state in host memory while a save is in flight. false: every save
    # holds the loop until it is committed.
    async_save: bool = True
    # Snapshot the whole state into host shared memory every N steps, each rank's shard replicated on a
    # peer rank (another node when there are several); a restarted job resumes from it without reading
    # the disk when it is at least as new as the newest checkpoint (null: no snapshots).
    in_memory_every: Optional[int] = None
