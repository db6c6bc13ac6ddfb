"""In-memory snapshots (trainer/checkpoint/memory.py), in one process: where replicas go, which snapshot the
ranks agree on, which files travel, and an exact resume of one process from its snapshot. The killed-rank
recovery over two processes is tests/test_checkpoint.py's
test_killed_ranks_restart_from_the_in_memory_replica_or_the_last_complete_checkpoint.

A SIGKILL while an asynchronous checkpoint is being written: one `python -m trainer trainer.max_restarts=1`
job (2 ddp ranks), a job of tests/launch_pool.py started with the shared launches (a killed rank would end a
shared launch)."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest

from trainer.checkpoint.memory import (
    METADATA_FILE,
    Held,
    choose_snapshot,
    peer_of,
    plan_transfers,
    rank_dir,
    snapshot_root,
)
from trainer.config import compose
from trainer.run import build_trainer
from tests.helpers import ASYNC_KILL_RECORD, LOSSES
from tests.launch_pool import POOL
from tests.test_checkpoint import BASE, CHECKPOINTS, STEPS, TWO, column


def test_the_replica_goes_to_the_same_local_rank_of_the_next_node_or_the_next_rank_on_one_node() -> None:
    # 2 nodes x 4: rank r's replica on r + 4 (mod 8), the other node
    assert [peer_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    # one node of 4: the next rank
    assert [peer_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]
    assert peer_of(0, 1, 1) == 0  # one process: no replica


def _held(step: int, shard: int) -> Held:
    return Held(step, shard, {f"__{shard}_0.distcp": 100 + shard, METADATA_FILE: 10})


def test_ranks_agree_on_the_newest_step_whose_every_shard_survives_somewhere() -> None:
    # step 9: rank 1 lost its part (own shard 1 and the replica of 0 it held), rank 0 still holds shard 1's
    # replica: restorable, shard 1 from rank 0
    reports = [[_held(9, 0), _held(9, 1)], []]
    choice, lost = choose_snapshot(reports, 2)
    assert choice is not None and choice.step == 9 and lost is None
    assert choice.holders == {"__0_0.distcp": [0], "__1_0.distcp": [0], METADATA_FILE: [0]}
    # both copies of shard 1 of step 9 gone, step 6 complete: step 6, and step 9 named as lost
    choice, lost = choose_snapshot([[_held(9, 0), _held(6, 0), _held(6, 1)], []], 2)
    assert choice is not None and choice.step == 6 and lost == (9, [1])
    assert choose_snapshot([[_held(9, 0)], []], 2) == (None, (9, [1]))
    assert choose_snapshot([[], []], 2) == (None, None)


def test_each_rank_fetches_only_what_it_needs_and_does_not_hold() -> None:
    holders = {"__0_0.distcp": [0, 1], "__1_0.distcp": [0], "__2_0.distcp": [1, 2]}
    needs = [["__0_0.distcp"], ["__0_0.distcp", "__1_0.distcp"], ["__0_0.distcp", "__2_0.distcp"]]
    assert plan_transfers(needs, holders) == [(0, 1, "__1_0.distcp"), (0, 2, "__0_0.distcp")]


@pytest.mark.parametrize("disk_every", [None, 4], ids=["memory-only", "older-disk"])
def test_one_process_resumes_exactly_from_its_in_memory_snapshot(tmp_path: Path, disk_every: int | None) -> None:
    """A run that fails at step 7 (no exception save) resumes from the snapshot of step 6, newer than the
    disk's step 4, and its losses are those of a run never interrupted; the run's end removes the snapshots."""
    run = BASE + ["trainer.micro_batch_size=4", "callbacks=[checkpoint]", "callbacks.checkpoint.in_memory_every=3",
                  "callbacks.checkpoint.save_on_exception=false"]
    if disk_every:
        run.append(f"callbacks.checkpoint.every_n_steps={disk_every}")
    failing = build_trainer(compose(run + ["+callbacks.fail._target_=tests.test_checkpoint.FailAtStep",
                                           "+callbacks.fail.step=7"]), tmp_path / "run")
    with pytest.raises(RuntimeError, match="injected failure at step 7"):
        failing.fit()
    root = snapshot_root(tmp_path / "run")
    assert [p.name for p in rank_dir(root, 0).iterdir()] == ["own-step_00000006"]
    resumed = build_trainer(compose(run), tmp_path / "run")
    assert resumed.step == 6
    resumed.fit()
    build_trainer(compose(run), tmp_path / "straight").fit()
    interrupted, straight = column(tmp_path / "run"), column(tmp_path / "straight")
    assert sorted(interrupted) == sorted(straight)
    assert [interrupted[s] for s in sorted(straight)] == [straight[s] for s in sorted(straight)]
    assert not root.exists()
    shutil.rmtree(root, ignore_errors=True)


# ---- a SIGKILL during an asynchronous write ----------------------------------------------------------------
ASYNC_KILL = POOL.jobs_root / "recovery" / "async-kill"
# Saves every 4 steps (asynchronous: the default); rank 1's write of step 8 stalls after its first item and
# rank 1 is SIGKILLed at the end of step 10, two steps later, with the write still in flight.
ASYNC_KILL_RUN = [*BASE, *TWO["ddp"], *CHECKPOINTS, "callbacks.checkpoint.every_n_steps=4", "trainer.max_restarts=1",
                  "+callbacks.kill._target_=tests.helpers.KillDuringAsyncWrite", "+callbacks.kill.save_step=8",
                  "+callbacks.kill.kill_step=10", "+callbacks.kill.rank=1", "+callbacks.kill.attempt=0"]
# the job starts from an empty directory (resume=auto would take a previous session's checkpoints)
POOL.add_job("recovery", [sys.executable, "-c", "import os, shutil, sys; shutil.rmtree(sys.argv[1], ignore_errors=True); "
                          "os.execve(sys.executable, [sys.executable, '-m', 'trainer', f'hydra.run.dir={sys.argv[1]}', "
                          "*sys.argv[2:]], {**os.environ, 'OMP_NUM_THREADS': '1'})", str(ASYNC_KILL), *ASYNC_KILL_RUN])


@pytest.mark.slow
def test_a_kill_during_an_asynchronous_write_resumes_from_the_previous_checkpoint() -> None:
    """Rank 1 was SIGKILLed at step 10 while its background write of the step-8 checkpoint was stalled halfway
    (rank 0's shard written, rank 1's partly, no DCP metadata, no manifest) and both ranks had trained two more
    steps. The restart finds that save uncommitted: it resumes from step 4, the previous checkpoint, with no
    damaged checkpoint on the way, removes the partial save, and recomputes steps 5-10 with the losses they had."""
    code, output = POOL.job("recovery")
    assert code == 0, output
    record = json.loads((ASYNC_KILL / ASYNC_KILL_RECORD).read_text())
    assert record["stalled"] and (record["save_step"], record["kill_step"]) == (8, 10), record
    files = record["partial_files"]
    assert files is not None and files["__1_0.distcp"] > 0 and files["__0_0.distcp"] > 0, record
    assert ".metadata" not in files and "checkpoint.json" not in files, record
    log = (ASYNC_KILL / "train.log").read_text()
    checkpoints = ASYNC_KILL / "checkpoints"
    assert f"checkpoint saved: {checkpoints / 'step_00000004'} (periodic, asynchronous): the loop stalled" in log
    assert f"removed an incomplete save (a process stopped while writing it): {checkpoints / '.step_00000008.partial'}" in log
    assert f"resumed from {checkpoints / 'step_00000004'} at step 4 (restart 1)" in log
    assert "falling back" not in log and "damaged" not in log
    # rank 0's local loss of every step, per attempt: the recomputed steps are the lost ones, bitwise
    losses: dict[int, dict[int, float]] = {}
    for line in (ASYNC_KILL / LOSSES).read_text().splitlines():
        entry = json.loads(line)
        losses.setdefault(entry["attempt"], {})[entry["step"]] = entry["loss"]
    assert sorted(losses) == [0, 1]
    assert sorted(losses[0]) == list(range(1, 11)) and sorted(losses[1]) == list(range(5, STEPS + 1))
    for first, again in zip([losses[0][s] for s in range(5, 11)], [losses[1][s] for s in range(5, 11)], strict=True):
        assert first == again
    with open(ASYNC_KILL / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")] == list(range(1, STEPS + 1))
    assert [p.name for p in sorted(checkpoints.iterdir())] == ["step_00000004", "step_00000008", f"step_{STEPS:08d}"]
    figures = json.loads((ASYNC_KILL / "summary.json").read_text())["checkpoints"]
    assert [(s["step"], s["asynchronous"]) for s in figures["saves"]] == [(8, True), (STEPS, True)]
    assert all(s["write_s"] is not None and s["stall_s"] >= s["call_s"] > 0 for s in figures["saves"])
