"""In-memory snapshots of the training state, each rank's shard replicated on a peer (`checkpoint.in_memory_every`).

A snapshot is the state a disk checkpoint holds (`collect_state`: model, optimizer, the trainer section with
the data position, the random generators, the callbacks' states), written by DCP into host shared memory
that outlives the worker processes, `/dev/shm/trainer-<hash of the run directory>/` (`snapshot_root`). Each
rank's part is its own directory there, `rank<R>/`, standing for that rank's host memory: a rank reads only
its own directory and gets everything else from the other ranks over torch.distributed (a gloo group), as
it would from another node:

    rank<R>/own-step_<N>/      this rank's DCP shard file, the snapshot's .metadata, snapshot.json
    rank<R>/replica-step_<N>/  the shard file of the rank whose peer R is (and .metadata, snapshot.json)

The peer of rank r is `peer_of(r)`: r + local_world_size (mod world), the same local rank on the next node,
or r + 1 on a single node. Both directories are written as hidden `.partial` ones and renamed when complete;
the older snapshot goes only once every rank has renamed the new one, so the latest complete snapshot is
always there. `restore_snapshot` (on a resume) has the ranks agree on the newest step whose every shard
is held somewhere (its own copy or its replica), fetch the files their layout reads from the ranks holding
them (point-to-point sends of the bytes), and load them with DCP from a staging directory in shared memory:
no disk is read. The run's end removes the snapshots (`remove_snapshots`); the launcher removes what a job
that failed left (trainer/launch.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from trainer.checkpoint.io import _agree, check_architecture, collect_state, finish_load, manifest_for, prepare_load
from trainer.checkpoint.manifest import CheckpointError
from trainer.checkpoint.storage import METADATA_FILE, SafeFileSystemReader, WeightsOnlyLoadPlanner, dcp_call, read_metadata

if TYPE_CHECKING:
    from trainer.loop import Trainer

log = logging.getLogger("trainer")
SHARED_MEMORY = Path("/dev/shm")
SNAPSHOT_FILE = "snapshot.json"
OWN, REPLICA = "own", "replica"


def snapshot_root(run_dir: Path | str) -> Path:
    """Where the in-memory snapshots of the run in `run_dir` live: the same path for every attempt of the
    job (a restart finds them), another for every run directory."""
    base = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    digest = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return base / f"trainer-{digest}"


def rank_dir(root: Path, rank: int) -> Path:
    """Rank `rank`'s part of the snapshots (its host memory)."""
    return root / f"rank{rank:05d}"


def snapshot_dir(root: Path, rank: int, kind: str, step: int) -> Path:
    return rank_dir(root, rank) / f"{kind}-step_{step:08d}"


def peer_of(rank: int, world: int, local_world: int) -> int:
    """The rank holding `rank`'s replica: the same local rank on the next node, or the next rank on one node."""
    if world < 2:
        return rank
    peer = (rank + local_world) % world
    return peer if peer != rank else (rank + 1) % world


# ---- what the ranks hold and which snapshot they restore (pure: unit-tested in one process) ------------------
@dataclass
class Held:
    """A complete snapshot directory of one rank: whose shard it holds and its files' sizes."""

    step: int
    shard_rank: int
    files: dict[str, int]  # file name -> bytes (the shard file and .metadata)


@dataclass
class Choice:
    """The snapshot the ranks restore: its step and, per file, the ranks holding it (ascending)."""

    step: int
    holders: dict[str, list[int]]
    sizes: dict[str, int]


def scan(directory: Path, world: int) -> list[Held]:
    """The complete snapshot directories of one rank's part (saved by a run of `world` ranks)."""
    held = []
    if not directory.is_dir():
        return held
    for path in sorted(directory.iterdir()):
        if path.name.startswith(".") or not (path / SNAPSHOT_FILE).is_file():
            continue
        try:
            record = json.loads((path / SNAPSHOT_FILE).read_text())
        except (OSError, ValueError):
            continue
        if record.get("world_size") != world:
            continue
        files = {name: (path / name).stat().st_size for name in record["files"] if (path / name).is_file()}
        if len(files) == len(record["files"]):
            held.append(Held(int(record["step"]), int(record["shard_rank"]), files))
    return held


def choose_snapshot(reports: list[list[Held]], world: int) -> tuple[Optional[Choice], Optional[tuple[int, list[int]]]]:
    """The newest step every rank's shard of which some rank holds, and the newest step that is not
    restorable with the ranks whose shards are lost there (None when the newest is restorable)."""
    steps = sorted({held.step for report in reports for held in report}, reverse=True)
    newest_lost: Optional[tuple[int, list[int]]] = None
    for step in steps:
        holders: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        shards: set[int] = set()
        for rank, report in enumerate(reports):
            for held in report:
                if held.step == step:
                    shards.add(held.shard_rank)
                    for name, size in held.files.items():
                        holders.setdefault(name, []).append(rank)
                        sizes[name] = size
        lost = sorted(set(range(world)) - shards)
        if not lost:
            return Choice(step, {name: sorted(set(ranks)) for name, ranks in holders.items()}, sizes), newest_lost
        if newest_lost is None:
            newest_lost = (step, lost)
    return None, newest_lost


def plan_transfers(needs: list[list[str]], holders: dict[str, list[int]]) -> list[tuple[int, int, str]]:
    """(source, destination, file) for every file a rank needs and does not hold; the sources spread over
    the holders of each file. The same list on every rank (it is computed from gathered data)."""
    transfers = []
    for destination, names in enumerate(needs):
        for name in sorted(names):
            ranks = holders.get(name)
            if not ranks:
                raise CheckpointError(f"in-memory snapshot: no rank holds {name}")
            if destination not in ranks:
                transfers.append((ranks[destination % len(ranks)], destination, name))
    return transfers


# ---- moving bytes between ranks -------------------------------------------------------------------------------
def exchange(transfers: list[tuple[int, int, str]], rank: int, local: dict[str, Path], sizes: dict[str, int],
             group: Any) -> dict[str, torch.Tensor]:
    """Run `transfers` (point-to-point over `group`, one tag per transfer): send the files this rank is the
    source of, return the ones it receives (name -> bytes as a uint8 tensor)."""
    works, received = [], {}
    for tag, (source, destination, name) in enumerate(transfers):
        if source == rank:
            data = torch.from_file(str(local[name]), shared=False, size=sizes[name], dtype=torch.uint8)
            works.append(dist.isend(data, destination, group=group, tag=tag))
        if destination == rank:
            buffer = torch.empty(sizes[name], dtype=torch.uint8)
            received[name] = buffer
            works.append(dist.irecv(buffer, source, group=group, tag=tag))
    for work in works:
        work.wait()
    return received


def _write(path: Path, data: torch.Tensor) -> None:
    data.numpy().tofile(path)


# ---- saving ---------------------------------------------------------------------------------------------------
def save_snapshot(trainer: "Trainer", root: Path, group: Any, local_world: int) -> float:
    """Snapshot the state of this step into shared memory with its replica on the peer (collective); the
    previous snapshot goes once every rank has the new one. Returns the seconds the loop stood still."""
    start = time.perf_counter()
    with trainer.untimed():
        _save_snapshot(trainer, root, group, local_world)
    return time.perf_counter() - start


def _save_snapshot(trainer: "Trainer", root: Path, group: Any, local_world: int) -> None:
    strategy = trainer.strategy
    rank, world, step = strategy.rank, strategy.world_size, trainer.step
    if strategy.is_global_zero:
        # as before a disk save: a run resumed from this snapshot finds every step it does not redo in
        # metrics.csv, also after a SIGKILL right after it
        trainer.flush_loggers()
    mine = rank_dir(root, rank)
    own = snapshot_dir(root, rank, OWN, step)
    own_partial = own.with_name(f".{own.name}.partial")
    shutil.rmtree(own_partial, ignore_errors=True)
    own_partial.mkdir(parents=True)
    state = collect_state(trainer)
    # No fsync: shared memory is not a disk, and a snapshot is worth something only while the node is up.
    writer = FileSystemWriter(own_partial, single_file_per_rank=True, sync_files=False)
    with dcp_call() as no_dist:
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(), no_dist=no_dist)
    shard = f"__{rank}_0.distcp"
    # DCP's coordinator (rank 0) wrote the metadata into its own directory: every directory gets a copy.
    metadata = strategy.broadcast_object((own_partial / METADATA_FILE).read_bytes() if strategy.is_global_zero else None)
    manifest = manifest_for(trainer, "in-memory", None)
    if not strategy.is_global_zero:
        (own_partial / METADATA_FILE).write_bytes(metadata)
    record = {"step": step, "world_size": world, "shard_rank": rank, "files": [shard, METADATA_FILE],
              "manifest": manifest}
    (own_partial / SNAPSHOT_FILE).write_text(json.dumps(record))
    if world > 1:
        sizes = trainer.strategy.all_gather_object((own_partial / shard).stat().st_size)
        transfers = [(source, peer_of(source, world, local_world), f"__{source}_0.distcp") for source in range(world)]
        received = exchange(transfers, rank, {shard: own_partial / shard},
                            {f"__{source}_0.distcp": size for source, size in enumerate(sizes)}, group)
        (name, data), = received.items()
        source = int(name[2:].split("_")[0])
        replica = snapshot_dir(root, rank, REPLICA, step)
        replica_partial = replica.with_name(f".{replica.name}.partial")
        shutil.rmtree(replica_partial, ignore_errors=True)
        replica_partial.mkdir(parents=True)
        _write(replica_partial / name, data)
        (replica_partial / METADATA_FILE).write_bytes(metadata)
        (replica_partial / SNAPSHOT_FILE).write_text(json.dumps({**record, "shard_rank": source, "files": [name, METADATA_FILE]}))
        shutil.rmtree(replica, ignore_errors=True)
        replica_partial.rename(replica)
    shutil.rmtree(own, ignore_errors=True)
    own_partial.rename(own)
    # The new snapshot counts once every rank's own part and replica are in place: only then go the older ones.
    _agree(trainer, None)
    keep = {own.name, snapshot_dir(root, rank, REPLICA, step).name}
    for path in mine.iterdir():
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


# ---- restoring ------------------------------------------------------------------------------------------------
def restore_snapshot(trainer: "Trainer", root: Path, group: Any, disk_step: Optional[int]) -> Optional[int]:
    """Restore the newest in-memory snapshot every shard of which is held by some rank, when it is newer
    than `disk_step` (the newest disk checkpoint's; memory wins a tie). Collective. Returns the step
    restored, or None (nothing newer in memory, or a shard lost with both its copies: said in one line)."""
    strategy = trainer.strategy
    rank, world = strategy.rank, strategy.world_size
    reports = trainer.strategy.all_gather_object(scan(rank_dir(root, rank), world))
    choice, lost = choose_snapshot(reports, world)
    if choice is None:
        if lost is not None and strategy.is_global_zero:
            log.warning(f"in-memory snapshot of step {lost[0]} lost: the shard(s) of rank(s) {lost[1]} have neither "
                        f"their own copy nor their replica; resuming from the newest disk checkpoint instead")
        return None
    if disk_step is not None and disk_step > choice.step:
        if strategy.is_global_zero:
            log.info(f"the disk checkpoint of step {disk_step} is newer than the in-memory snapshot of step "
                     f"{choice.step}: resuming from disk")
        return None
    if lost is not None and strategy.is_global_zero:
        log.warning(f"in-memory snapshot of step {lost[0]} lost the shard(s) of rank(s) {lost[1]} (both copies); "
                    f"the one of step {choice.step} is complete")
    with trainer.untimed():
        _restore(trainer, root, group, choice, world)
    return choice.step


def _restore(trainer: "Trainer", root: Path, group: Any, choice: Choice, world: int) -> None:
    strategy = trainer.strategy
    rank, step = strategy.rank, choice.step
    local: dict[str, Path] = {}
    for kind in (OWN, REPLICA):
        directory = snapshot_dir(root, rank, kind, step)
        if (directory / SNAPSHOT_FILE).is_file():
            for name in json.loads((directory / SNAPSHOT_FILE).read_text())["files"]:
                local.setdefault(name, directory / name)
    # Every rank needs the metadata and the manifest before it knows which shard files its layout reads.
    metadata_holder = choice.holders[METADATA_FILE][0]
    holder = rank == metadata_holder
    shared = [_record(local) if holder else None, local[METADATA_FILE].read_bytes() if holder else None]
    if group is not None:
        dist.broadcast_object_list(shared, src=metadata_holder, group=group)
    record, metadata_bytes = shared
    manifest = record["manifest"]
    check_architecture(trainer, manifest, f"in-memory snapshot of step {step}")
    staging = rank_dir(root, rank) / f".restore-step_{step:08d}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        (staging / METADATA_FILE).write_bytes(metadata_bytes)
        metadata = read_metadata(staging)
        request = prepare_load(trainer, manifest, set(metadata.state_dict_metadata),
                               f"in-memory snapshot of step {step}", weights_only=False)
        needs = strategy.all_gather_object(sorted(files_needed(request.state, metadata, strategy.is_global_zero)))
        transfers = plan_transfers(needs, choice.holders)
        for name in needs[rank]:
            if name in local and name != METADATA_FILE:
                os.link(local[name], staging / name)  # same tmpfs: no copy
        for name, data in exchange(transfers, rank, local, choice.sizes, group).items():
            _write(staging / name, data)
        fetched = [f"{name} from rank {source}" for source, destination, name in transfers if destination == rank]
        if fetched:
            log.warning(f"in-memory snapshot of step {step}: fetched {', '.join(fetched)}")
        with dcp_call() as no_dist:
            dcp.load(request.state, storage_reader=SafeFileSystemReader(staging), planner=WeightsOnlyLoadPlanner(),
                     no_dist=no_dist)
        finish_load(trainer, request, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _record(local: dict[str, Path]) -> dict[str, Any]:
    """The snapshot.json beside this rank's copy of the metadata."""
    return json.loads((local[METADATA_FILE].parent / SNAPSHOT_FILE).read_text())


def files_needed(state: dict[str, Any], metadata: Metadata, is_coordinator: bool) -> set[str]:
    """The storage files a load of `state` reads (DCP's own read plan, made without reading anything)."""
    planner = WeightsOnlyLoadPlanner()
    planner.set_up_planner(state, metadata, is_coordinator)
    plan = planner.create_local_plan()
    storage = metadata.storage_data
    return {storage[item.storage_index].relative_path for item in plan.items}  # .metadata: broadcast


def remove_snapshots(root: Path, rank: int) -> None:
    """Remove this rank's part of the snapshots (each rank its own; the empty root goes with the last)."""
    shutil.rmtree(rank_dir(root, rank), ignore_errors=True)
    try:
        root.rmdir()
    except OSError:
        pass
