"""In-memory snapshots (trainer/checkpoint/memory.py), in one process: where replicas go, which snapshot the
ranks agree on, which files travel, and an exact resume of one process from its snapshot. The killed-rank
recovery over two processes is tests/test_checkpoint.py's
test_killed_rank_recovers_from_the_in_memory_replica_and_falls_back_to_disk_when_both_copies_are_lost."""

from __future__ import annotations

import shutil
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
from tests.test_checkpoint import BASE, column


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
