"""Runs several training configurations inside one multi-process launch.

Starting processes costs seconds on a 2-core machine, so the multi-process tests batch their runs:
`python tests/harness_launcher.py N SPEC.json` starts N workers running `main(SPEC.json)`, where SPEC lists
named override lists (tests/launch_pool.py gathers the session's runs into one SPEC per world size); under
`torchrun --nproc-per-node N tests/distributed_harness.py SPEC.json` each worker runs this file. Each run
writes, from rank 0, `<dir>/summary.json` (with per-step losses from metrics.csv next to it) and `<dir>/weights.pt`
(the full final weights), where `<dir>` is the run's `dir` or else `<out>/<name>`. With
`"count_collectives": true` in SPEC or in a run, its summary also gets `collective_calls`: rank 0's
collectives over the run's own process groups, by operation, from torch's flight recorder.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.collectives import (DEFAULT_FR_ENTRIES, enable_flight_recorder, flight_recorder_entries,  # noqa: E402
                                 group_names)
from trainer.config import compose  # noqa: E402
from trainer.launch import configure_worker_logging  # noqa: E402
from trainer.preemption import TrainingPreempted  # noqa: E402
from trainer.run import build_trainer  # noqa: E402


# The flight recorder's ring when a run counts its collectives: the trainer's default (2,000 records), which
# holds one run's records several times over (the largest, an 8-process 3d run, makes about 620; a counted
# run whose first record was overwritten fails), and no larger, because every process group of the launch
# records into it and the straggler report (trainer/hang.py) reads all of it at each log step: at 60,000
# records one read took 1.7 s, at 2,000 30 ms (measured: one gloo process, 16-element all-reduces).
RING_ENTRIES = DEFAULT_FR_ENTRIES


def main(spec_path: str | None = None) -> None:
    spec = json.loads(Path(spec_path or sys.argv[1]).read_text())
    counted = [bool(spec.get("count_collectives") or run.get("count_collectives")) for run in spec["runs"]]
    if any(counted):
        enable_flight_recorder(entries=RING_ENTRIES)
    dist.init_process_group("gloo")
    # The imported modules (some 300,000 objects) are never garbage: frozen, the collection after each run
    # scans only what the runs made (it took 1.2 s a run before, a fifth of a small run's time).
    gc.freeze()
    rank = dist.get_rank()
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    configure_worker_logging(rank, out)
    for run, count in zip(spec["runs"], counted, strict=True):
        started = time.perf_counter()
        run_dir = Path(run["dir"]) if "dir" in run else out / run["name"]
        cfg = composed(run["overrides"])
        first_record = next_record_id() if count else 0  # after the config's broadcast: the run's own calls
        run_log = run_logging(rank, run_dir)
        trainer = build_trainer(cfg, run_dir)
        try:
            summary = trainer.fit()
        except TrainingPreempted as stopped:  # a run a test signals: saved, then stopped (trainer/preemption.py)
            summary = {"preempted": str(stopped), "steps": stopped.step}
        if count:
            summary["collective_calls"] = collective_calls(first_record, trainer.strategy.dims)
            summary["fsdp_units"] = sum(isinstance(m, FSDPModule) for part in trainer.model_parts
                                        for m in part.modules())
        weights = trainer.strategy.full_state_dict(trainer.model_parts)
        if rank == 0:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            torch.save(weights, run_dir / "weights.pt")
        dist.barrier()
        # Drop each run (DDP's reducer holds the process group) while the group lives: see
        # trainer.run.train. The group itself is this script's, so teardown leaves it alone.
        trainer.strategy.teardown()
        trainer = None
        gc.collect()
        if run_log is not None:
            logging.getLogger().removeHandler(run_log)
            run_log.close()
        if rank == 0:  # the run's whole cost in the launch, for the session's summary (tests/conftest.py)
            (run_dir / "seconds.txt").write_text(f"{time.perf_counter() - started:.2f}\n")
    dist.destroy_process_group()


def composed(overrides: list[str]) -> DictConfig:
    """The run's config: composed by rank 0 and sent to the others (composing costs each rank 0.4 s of CPU,
    the same work on every rank)."""
    box: list[DictConfig | None] = [compose(overrides) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def run_logging(rank: int, run_dir: Path) -> logging.Handler | None:
    """Rank 0 also logs each run into `<run_dir>/train.log` (the launch's own train.log holds every run's
    lines), so a test reads what its run said when the session's runs share a launch."""
    if rank != 0:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def next_record_id() -> int:
    """The flight recorder's next record id (its records are numbered in call order)."""
    return max((int(entry.get("record_id", -1)) for entry in flight_recorder_entries()), default=-1) + 1


def collective_calls(first_record: int, dims: object) -> dict[str, int]:
    """This rank's collectives of at least 1,024 elements (gradient and parameter traffic, not the scalar
    losses and norms) since `first_record`, counted by `operation@group` as the flight recorder names the
    operation (on gloo a reduce-scatter is an `all_reduce` of the whole input) and the parallel dimension
    names the group (`ParallelDims.named_groups`)."""
    names = group_names(dims)
    counts: Counter[str] = Counter()
    entries = flight_recorder_entries()
    oldest = min((int(entry.get("record_id", -1)) for entry in entries), default=first_record)
    if oldest > first_record:
        raise RuntimeError(f"the flight recorder's ring ({RING_ENTRIES} records) wrapped during the run: its "
                           f"first record {first_record} is gone (oldest kept {oldest}); raise RING_ENTRIES")
    for entry in entries:
        sizes = entry.get("input_sizes") or [[]]
        if int(entry.get("record_id", -1)) < first_record or math.prod(sizes[0]) < 1024:
            continue
        op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
        group = names.get(str(entry.get("process_group", ("?", ""))[0]), "?")
        counts[f"{op}@{group}"] += 1
    return dict(counts)


if __name__ == "__main__":  # a worker of `torchrun ... tests/distributed_harness.py SPEC.json`
    main()
