"""Saving and loading the whole training state with torch.distributed.checkpoint (DCP).

Both functions are collective: every rank of the run calls them with the same path. Each rank writes
only its own shards (a replicated value is written once); loading reads whatever slices this rank's
layout needs, so a checkpoint saved under one strategy and world size loads under another.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer.checkpoint import space
from trainer.checkpoint.manifest import (
    CONFIG,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNoSpaceError,
    latest_complete_checkpoint,
    commit,
    partial_path,
    read_manifest,
    verify_files,
)
from trainer.checkpoint.state import (
    MODEL_PREFIX,
    MASTER_WEIGHT,
    OPTIM_PREFIX,
    RNG_PREFIX,
    TRAINER_KEY,
    architecture_mismatch,
    initialize_optimizer_state,
    load_model_state,
    load_optimizer_state,
    load_rng_state,
    load_trainer_state,
    model_config_dict,
    model_state,
    optimizer_entries,
    optimizer_state,
    optimizer_template,
    rng_state,
    trainer_state,
)
from trainer.checkpoint.storage import (
    SafeFileSystemReader,
    WeightsOnlyLoadPlanner,
    dcp_call,
    pack,
    read_metadata,
    unpack,
)

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")


def _agree(trainer: "Trainer", error: Optional[BaseException]) -> None:
    """Raise on every rank when any rank failed, so that no rank goes on to a collective the failed one
    will never join."""
    failures = trainer.strategy.all_gather_object(None if error is None else str(error))
    if error is not None:
        raise error
    for rank, message in enumerate(failures):
        if message is not None:
            raise CheckpointError(f"rank {rank}: {message}")


def manifest_for(trainer: "Trainer", reason: str, metrics: Optional[dict[str, float]]) -> dict[str, Any]:
    """The manifest fields describing the state saved now (a checkpoint's and an in-memory snapshot's)."""
    strategy = trainer.strategy
    dims = strategy.parallel_dims
    return {
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "reason": reason,
        "world_size": strategy.world_size,
        "strategy": strategy.name,
        "parallel_dims": dims.sizes() if dims is not None else {},
        "metrics": dict(metrics or {}),
        "model": model_config_dict(trainer),
    }


def _config_yaml(trainer: "Trainer") -> Optional[str]:
    config = Path(trainer.run_dir) / CONFIG
    return config.read_text() if config.is_file() else None


def collect_state(trainer: "Trainer") -> dict[str, Any]:
    """The flat DCP state dict of the whole run (see trainer.checkpoint.state); calls on_save_checkpoint."""
    state: dict[str, Any] = {f"{MODEL_PREFIX}{key}": value for key, value in model_state(trainer.model_parts).items()}
    entries = optimizer_entries(trainer)
    state.update(optimizer_state(entries, trainer.optimizer))
    section = trainer_state(trainer)
    for callback in trainer.callbacks:
        callback.on_save_checkpoint(trainer, section)
    if trainer.strategy.is_global_zero:  # the same everywhere: written from rank 0, read by every rank
        state[TRAINER_KEY] = pack(section)
    state[f"{RNG_PREFIX}{trainer.strategy.rank}"] = pack(rng_state())
    return state


def background_stager(device_type: str) -> DefaultStager:
    """The stager of a run's asynchronous saves: it copies the state to host memory in a thread of its own
    (the loop goes on with the next step's forward and backward meanwhile, and waits for the copy before its
    optimizer step: `PendingCheckpoint.wait_staged`), into host buffers it keeps from one save to the next
    (one pass over the bytes; pinned, and copied on a stream of its own, on a GPU). Closed by its owner
    at the end of the run."""
    on_gpu = device_type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=True,
                                        use_non_blocking_copy=on_gpu))


class PendingCheckpoint:
    """An asynchronous save in flight: this rank's shards are being written in a background thread.

    The state is copied to host memory first, in the background too when the save was given a stager
    (`background_stager`): until `staged()`, the state's tensors must not change, so the loop calls
    `wait_staged()` before its optimizer step. Then training may change them.
    Rank 0 commits the checkpoint (manifest, rename) from the completion of DCP's write, which is collective:
    DCP's coordinator writes the metadata and completes only once every rank reported its shards written
    (and fsynced). A rank killed while writing therefore leaves the `.partial` directory uncommitted, which
    discovery ignores. `wait()` blocks until this rank's part (and on rank 0 the commit) is done and raises
    if the save failed; `finish_checkpoint` is its collective form.
    """

    def __init__(self, future: Future, partial: Path, path: Path, manifest: dict[str, Any],
                 config_yaml: Optional[str], committer: bool, needed: int = 0,
                 staging: Optional[Future] = None) -> None:
        self.path = path
        self.partial = partial
        self.step = int(manifest["step"])
        self.needed = needed  # the expected size in bytes (a no-space failure reports it)
        # Seconds from the hand-over to the background thread to the end of this rank's write (on rank 0,
        # of the commit too); None while in flight.
        self.write_s: Optional[float] = None
        self._submitted = time.perf_counter()
        self._future = future
        self._staging = staging  # None: staged before this object existed
        self._committer = committer
        self._finished = threading.Event()
        self._error: Optional[BaseException] = None
        # Runs in the writing thread when the write ends (at once when it has already ended).
        future.add_done_callback(lambda done: self._written(done, partial, manifest, config_yaml))

    def _written(self, future: Future, partial: Path, manifest: dict[str, Any], config_yaml: Optional[str]) -> None:
        try:
            if self._committer:
                future.result()  # raises when any rank's write failed: then nothing is committed
                commit(partial, self.path, manifest, config_yaml)
        except BaseException as error:  # noqa: BLE001 - reported by wait() in the main thread
            self._error = error
        finally:
            self.write_s = time.perf_counter() - self._submitted
            self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def staged(self) -> bool:
        """Whether the state's copy in host memory is complete (the live tensors may change)."""
        return self._staging is None or self._staging.done()

    def wait_staged(self) -> None:
        """Block until the copy to host memory is complete; CheckpointError if it failed (the write then
        fails too, and `wait` reports it)."""
        if self._staging is None:
            return
        try:
            self._staging.result()
        except Exception as error:  # noqa: BLE001 - reported as the save's failure
            raise CheckpointError(f"copying the state of step {self.step} to host memory failed: {error}") from error

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Block until this rank's write (rank 0: and the commit) ended; CheckpointError if the save failed,
        TimeoutError after `timeout` seconds."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the asynchronous save of {self.path} did not finish within {timeout} s")
        try:
            self._future.result()
        except BaseException as error:
            raise CheckpointError(f"asynchronous save of {self.path} failed: {error}") from error
        if self._error is not None:
            raise CheckpointError(f"committing {self.path} failed: {self._error}") from self._error
        return self.path


def finish_checkpoint(trainer: "Trainer", pending: PendingCheckpoint) -> Path:
    """Wait for an asynchronous save on every rank and agree on its outcome (collective): the disk filling up
    during the background write is reported as a synchronous save reports it (the partial save removed by rank
    0, CheckpointNoSpaceError naming the disk and the kept checkpoint); any other failure is a CheckpointError
    on every rank. Its time is not training time."""
    error: Optional[CheckpointError] = None
    with trainer.untimed():
        try:
            pending.wait()
        except CheckpointError as failure:
            error = failure
    reports = trainer.strategy.all_gather_object(
        None if error is None else (str(error), space.is_no_space(error)))
    if any(report is not None and report[1] for report in reports):
        raise _no_space(trainer, pending.path, pending.partial, pending.needed) from None
    if error is not None:
        raise error
    for rank, report in enumerate(reports):
        if report is not None:
            raise CheckpointError(f"rank {rank}: {report[0]}")
    return pending.path


def save_checkpoint(trainer: "Trainer", path: Path | str, *, reason: str = "manual",
                    metrics: Optional[dict[str, float]] = None, asynchronous: bool = False,
                    process_group: Any = None, stager: Optional[DefaultStager] = None) -> Path | PendingCheckpoint:
    """Save the whole training state to `path` (collective; atomic).

    Every rank writes its shards into a hidden `.partial` sibling; once all have finished, rank 0 writes
    the manifest and renames the directory to `path`, so `path` only ever exists complete. With
    `asynchronous`, the state is copied to host memory, written in a background thread over
    `process_group` (a gloo group other than the training one: the thread's collectives must not
    interleave with the loop's), and a PendingCheckpoint is returned, committed by rank 0 once every rank
    has written (`finish_checkpoint` waits for it). With a `stager` (`background_stager`) the copy to host
    memory happens in the background too (the caller waits for it before changing the state:
    `PendingCheckpoint.wait_staged`); without one, before this returns. Its time is not training time: the
    run's tokens/s leaves it out (`Trainer.untimed`).
    """
    with trainer.untimed():
        return _save_checkpoint(trainer, Path(path), reason, metrics, asynchronous, process_group, stager)


def _save_checkpoint(trainer: "Trainer", path: Path, reason: str, metrics: Optional[dict[str, float]],
                     asynchronous: bool, process_group: Any,
                     stager: Optional[DefaultStager]) -> Path | PendingCheckpoint:
    strategy = trainer.strategy
    partial = partial_path(path)
    error: Optional[BaseException] = None
    if strategy.is_global_zero:
        # The metrics of this step and before go to disk first: a run resumed from this checkpoint must
        # find every step it does not redo in metrics.csv, also after a SIGKILL right after the commit.
        trainer.flush_loggers()
        try:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as failure:
            error = CheckpointError(f"cannot create {partial}: {failure}")
    _agree(trainer, error)
    state = collect_state(trainer)
    needed = _check_space(trainer, state, path, partial)
    manifest = manifest_for(trainer, reason, metrics)
    config_yaml = _config_yaml(trainer)
    writer = FileSystemWriter(partial, single_file_per_rank=True, sync_files=True)
    planner = DefaultSavePlanner()
    if asynchronous:
        with dcp_call() as no_dist:
            response = dcp.async_save(state, storage_writer=writer, planner=planner, process_group=process_group,
                                      async_stager=stager, no_dist=no_dist)
        # with a stager whose copy runs in the background: an AsyncSaveResponse (staging, then upload)
        future = getattr(response, "upload_completion", response)
        return PendingCheckpoint(future, partial, path, manifest, config_yaml, strategy.is_global_zero, needed,
                                 staging=getattr(response, "staging_completion", None))
    try:
        with dcp_call() as no_dist:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=no_dist)
    except BaseException as failure:  # DCP's CheckpointException is a BaseException
        if not space.is_no_space(failure):
            raise
        # Every rank has stopped writing (DCP gathers the ranks' results before raising on each).
        raise _no_space(trainer, path, partial, needed) from None
    if strategy.is_global_zero:
        try:
            commit(partial, path, manifest, config_yaml)
        except OSError as failure:
            error = (_no_space(trainer, path, partial, needed) if space.is_no_space(failure)
                     else CheckpointError(f"cannot commit {path}: {failure}"))
    _agree(trainer, error)
    return path


def _check_space(trainer: "Trainer", state: dict[str, Any], path: Path, partial: Path) -> int:
    """Refuse a save the disk cannot hold (collective: one all_gather of each rank's share and rank 0's
    view of the disk), before anything is written; returns the expected size in bytes."""
    strategy = trainer.strategy
    share = space.state_bytes(state, counts_replicated=strategy.is_global_zero)
    disk: Optional[tuple[str, int, int]] = None
    if strategy.is_global_zero:
        mount, free = space.disk_of(partial)
        disk = (str(mount), free, space.previous_checkpoint_bytes(path.parent))
    reports = strategy.all_gather_object((share, disk))
    mount, free, previous = reports[0][1]
    needed = max(sum(report[0] for report in reports), previous)
    if needed > free:
        if strategy.is_global_zero:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointNoSpaceError(f"the checkpoint of step {trainer.step} needs {space.human(needed)}, "
                                     f"{space.human(free)} free on {mount} ({path.parent}): free some space "
                                     "or point the checkpoint directory at another disk")
    return needed


def _no_space(trainer: "Trainer", path: Path, partial: Path, needed: int) -> CheckpointNoSpaceError:
    """The disk filled during the save: the partial save goes (rank 0), the earlier checkpoints stay."""
    if trainer.strategy.is_global_zero:
        shutil.rmtree(partial, ignore_errors=True)
    mount, free = space.disk_of(path.parent)
    previous = latest_complete_checkpoint(path.parent)
    kept = f"the last complete checkpoint {previous} is kept" if previous is not None else "no earlier checkpoint"
    return CheckpointNoSpaceError(f"no space left on {mount} while writing the checkpoint of step {trainer.step} "
                                  f"({space.human(needed)} expected, {space.human(free)} free after removing "
                                  f"the partial save {partial.name}); {kept}")


def verify_checkpoint(trainer: "Trainer", path: Path, manifest: dict[str, Any], checksums: bool = True) -> None:
    """Check every file against the manifest, the work spread over the ranks; raise on every rank."""
    names = sorted(manifest["files"])
    rank, world = trainer.strategy.rank, trainer.strategy.world_size
    error: Optional[BaseException] = None
    try:
        verify_files(path, names[rank::world], manifest, checksums=checksums)
    except CheckpointCorruptError as failure:
        error = failure
    failures = trainer.strategy.all_gather_object(None if error is None else str(error))
    for message in failures:
        if message is not None:
            if error is not None:
                raise error
            raise CheckpointCorruptError(message, path)


def load_checkpoint(trainer: "Trainer", path: Path | str, *, weights_only: bool = False,
                    verify: bool = True) -> dict[str, Any]:
    """Restore the training state saved at `path` into `trainer` (collective; reshards as needed).

    Weights and optimizer states load into this run's layout whatever the saving run's strategy and
    world size; counters, data position, schedule, loss scaler and callback states are restored; the
    random generators too when the world size is unchanged (each rank its own). `weights_only` loads
    the model weights alone (a fine-tune starting from a checkpoint). Every file is checked against the
    manifest first: a damaged checkpoint raises CheckpointCorruptError naming the file, on every rank.
    Returns the manifest. Its time is not training time (a rollback's load: `Trainer.untimed`).
    """
    with trainer.untimed():
        return _load_checkpoint(trainer, Path(path), weights_only, verify)


def _load_checkpoint(trainer: "Trainer", path: Path, weights_only: bool, verify: bool) -> dict[str, Any]:
    manifest = read_manifest(path)
    check_architecture(trainer, manifest, str(path))
    if verify:
        verify_checkpoint(trainer, path, manifest)
    request = prepare_load(trainer, manifest, set(read_metadata(path).state_dict_metadata), str(path), weights_only)
    try:
        with dcp_call() as no_dist:
            dcp.load(request.state, storage_reader=SafeFileSystemReader(path), planner=WeightsOnlyLoadPlanner(),
                     no_dist=no_dist)
    except CheckpointException as error:
        rank, failure = next(iter(error.failures.items()))
        raise CheckpointError(f"loading checkpoint {path} failed on rank {rank}: {failure}") from None
    finish_load(trainer, request, manifest)
    return manifest


def check_architecture(trainer: "Trainer", manifest: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint (or in-memory snapshot) saved for another model."""
    problems = architecture_mismatch(manifest.get("model"), model_config_dict(trainer))
    if problems:
        raise CheckpointError(f"checkpoint {source} was saved for another model: " + "; ".join(problems))


@dataclass
class LoadRequest:
    """What one rank reads from a checkpoint: the DCP state dict to fill, and how to apply it."""

    state: dict[str, Any]
    entries: list[Any]
    weights_only: bool
    restore_rng: bool


def prepare_load(trainer: "Trainer", manifest: dict[str, Any], saved_keys: set[str], source: str,
                 weights_only: bool) -> LoadRequest:
    """The state dict this rank's layout reads from a checkpoint holding `saved_keys` (collective: a problem
    found by any rank, each holding other weights under pipelining, stops every rank before the load)."""
    strategy = trainer.strategy
    error: Optional[BaseException] = None
    state: dict[str, Any] = {f"{MODEL_PREFIX}{key}": value for key, value in model_state(trainer.model_parts).items()}
    missing = sorted(key[len(MODEL_PREFIX):] for key in state if key not in saved_keys)
    if missing:
        error = CheckpointError(f"checkpoint {source} has no weights for {', '.join(missing[:5])}"
                                + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    entries = []
    if not weights_only and any(key.startswith(OPTIM_PREFIX) for key in saved_keys):
        initialize_optimizer_state(trainer.optimizer)
        entries = optimizer_entries(trainer)
        optimizer_keys = optimizer_template(entries, trainer.optimizer)
        # A checkpoint without master weights (saved without bf16_true's masters): they restart from the
        # loaded weights, as they would from any weights written from outside.
        optimizer_keys = {key: value for key, value in optimizer_keys.items()
                          if key in saved_keys or not key.endswith(f".{MASTER_WEIGHT}")}
        absent = sorted(key for key in optimizer_keys if key not in saved_keys)
        if absent and error is None:
            error = CheckpointError(f"checkpoint {source} lacks optimizer states this run needs, e.g. {absent[0]} "
                                    "(saved with another optimizer?); start from its weights with init_from instead")
        state.update(optimizer_keys)
    _agree(trainer, error)
    restore_rng = False
    if not weights_only:
        state[TRAINER_KEY] = b""
        rng_key = f"{RNG_PREFIX}{strategy.rank}"
        restore_rng = manifest.get("world_size") == strategy.world_size and rng_key in saved_keys
        if restore_rng:
            state[rng_key] = b""
    return LoadRequest(state, entries, weights_only, restore_rng)


def finish_load(trainer: "Trainer", request: LoadRequest, manifest: dict[str, Any]) -> None:
    """Apply a loaded state dict: weights, then (unless weights only) optimizer, counters, RNG, callbacks."""
    strategy, state = trainer.strategy, request.state
    load_model_state(trainer.model_parts, {key[len(MODEL_PREFIX):]: value for key, value in state.items()
                                           if key.startswith(MODEL_PREFIX)})
    trainer.precision.weights_written()  # copies the optimizer steps (masters, offloaded) follow the weights
    if request.weights_only:
        return
    if request.entries:
        load_optimizer_state(request.entries, trainer.optimizer, state)
    section = unpack(state[TRAINER_KEY])
    load_trainer_state(trainer, section)
    if request.restore_rng:
        load_rng_state(unpack(state[f"{RNG_PREFIX}{strategy.rank}"]))
    elif strategy.is_global_zero:
        log.info(f"checkpoint saved on {manifest.get('world_size')} ranks, resumed on {strategy.world_size}: "
                 "random generators keep this run's seeds")
    for callback in trainer.callbacks:
        callback.on_load_checkpoint(trainer, section)
