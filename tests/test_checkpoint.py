"""Checkpoints: exact resume per strategy, resharding resume, faults (killed ranks, killed saves, damaged
files), retention policies and safe loading.

Exact resume compares STEPS = 12 steps straight with HALF = 6 steps + a resume for the other 6 (the
issue's numbers). Multi-process runs are batched into three launches: 4 processes (zero3 exact resume;
the zero3 checkpoint resumed under 3d tp=2 x dp=2 with ZeRO-1, which then saves for a single-process
resume), 2 processes (ddp stopped by SIGTERM on one rank, zero1 with synchronous saves, pp and pp under
DualPipeV's V placement exact resume; the zero3 checkpoint resumed under pp=2), and one `python -m trainer trainer.max_restarts=2` job
whose rank 1 is SIGKILLed twice. The 3d exact resume (pp=2 x dp=2 x tp=2) runs in tests/test_three_d.py's
8-process launch.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.callback import Callback
from trainer.checkpoint import (
    CheckpointCorruptError,
    CheckpointNoSpaceError,
    RetentionPolicy,
    complete_checkpoints,
    latest_complete_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.checkpoint.storage import UnsafeCheckpointError, read_metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from tests.launch_pool import POOL
from trainer.config import compose
from trainer.preemption import PreemptionSignals, TrainingPreempted
from trainer.run import build_trainer

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
# STEPS steps of 8 sequences x 32 tokens, every loss logged; validation at HALF and at the end.
STEPS, HALF = 12, 6
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.log_every=1",
        f"trainer.val_every={HALF}", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "data.max_bytes=200000",
        "trainer.peak_flops=1e12", "trainer.num_threads=1", "callbacks=none"]
BASE = MODEL + LOOP
CHECKPOINTS = ["callbacks=[checkpoint]"]
# Exact-resume strategies on 2 processes (micro-batch 4: one micro-batch per rank, or 2 pipeline ones);
# zero3 runs on 4, 3d on 8 (tests/test_three_d.py).
TWO = {
    "ddp": ["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=4"],
    "zero1_sync": ["strategy=zero1", "trainer.devices=2", "trainer.micro_batch_size=4"],
    "pp": ["strategy=pp", "pp=2", "trainer.devices=2", "trainer.micro_batch_size=4"],
    # the V placement (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2) under DualPipeV's 4 micro-batches
    "pp_dualpipev": ["strategy=pp", "pp=2", "strategy.schedule=dualpipev", "strategy.virtual_stages=2",
                     "model.n_layers=4", "trainer.devices=2", "trainer.micro_batch_size=2"],
}
# Options of the manager in the interrupted run: saves are asynchronous by default, zero1's synchronous.
MANAGER_OPTIONS = {"zero1_sync": ["callbacks.checkpoint.async_save=false"]}
ZERO3_4 = ["strategy=zero3", "trainer.devices=4", "trainer.micro_batch_size=2"]
# pp=2 x dp=2 x tp=2, ZeRO-1 over dp (the 3d default): 4 sequences per dp rank in 2 pipeline micro-batches.
THREE_D = ["strategy=3d", "pp=2", "tp=2", "trainer.devices=8", "trainer.micro_batch_size=2"]
# tp=2 x dp=2 with ZeRO-1 over dp: its optimizer steps Shard(0) views of tensor-parallel shards.
TP_DP = ["strategy=3d", "strategy.data_parallel=zero1", "tp=2", "pp=1", "trainer.devices=4", "trainer.micro_batch_size=4"]


# ---- callbacks the runs use (importable by the workers as tests.test_checkpoint.*) -----------------------
class SignalAtStep(Callback):
    """Send SIGTERM (or `signum`) to this process (on one rank) just before step `step` runs, as a scheduler
    would."""

    def __init__(self, step: int, rank: int = 0, signum: str = "SIGTERM") -> None:
        self.step = step
        self.rank = rank
        self.signum = signal.Signals[signum]

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        if trainer.step == self.step - 1 and trainer.strategy.rank == self.rank:
            os.kill(os.getpid(), self.signum)


class StopAfterSteps(Callback):
    """End fit() after `steps` steps of this run (to read the first resumed losses)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._start = 0

    def on_fit_start(self, trainer: Any) -> None:
        self._start = trainer.step

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.step - self._start >= self.steps:
            trainer.should_stop = True


class KillAtStep(Callback):
    """SIGKILL one rank at a step, in the given elastic attempt only (TORCHELASTIC_RESTART_COUNT)."""

    def __init__(self, step: int, rank: int = 1, attempt: int = 0) -> None:
        self.step, self.rank, self.attempt = step, rank, attempt

    def _armed(self, trainer: Any) -> bool:
        return (trainer.strategy.rank == self.rank and trainer.step == self.step
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == self.attempt)

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if self._armed(trainer):
            os.kill(os.getpid(), signal.SIGKILL)


class KillDuringSave(KillAtStep):
    """SIGKILL one rank while the checkpoint of `step` is being written (after the save has started)."""

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        pass

    def on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        if self._armed(trainer):
            os.kill(os.getpid(), signal.SIGKILL)


class LoseSnapshotAndKill(KillAtStep):
    """SIGKILL one rank at a step after removing in-memory snapshot copies as the loss of its node would:
    `lose=own` its part (its own shard and the replica it held), `lose=both` also the replica of its shard."""

    def __init__(self, step: int, rank: int = 1, attempt: int = 0, lose: str = "own") -> None:
        super().__init__(step, rank, attempt)
        self.lose = lose

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        from trainer.checkpoint.memory import SNAPSHOT_FILE, rank_dir, snapshot_root

        if self._armed(trainer):
            root = snapshot_root(trainer.run_dir)
            shutil.rmtree(rank_dir(root, self.rank))
            if self.lose == "both":
                for replica in root.glob("rank*/replica-*"):
                    if json.loads((replica / SNAPSHOT_FILE).read_text())["shard_rank"] == self.rank:
                        shutil.rmtree(replica)
            os.kill(os.getpid(), signal.SIGKILL)


class FailAtStep(Callback):
    """Raise at the end of a step (the state is consistent: the manager's exception save keeps it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")


HELPERS = {"signal": SignalAtStep, "stop": StopAfterSteps, "kill": KillAtStep, "kill_save": KillDuringSave,
           "lose": LoseSnapshotAndKill, "lose_both": LoseSnapshotAndKill,
           "fail": FailAtStep}


def helper(name: str, **options: Any) -> list[str]:
    """Overrides adding one of the callbacks above as `callbacks.<name>`."""
    target = f"+callbacks.{name}._target_=tests.test_checkpoint.{HELPERS[name].__name__}"
    return [target] + [f"+callbacks.{name}.{key}={value}" for key, value in options.items()]


def column(run_dir: Path, name: str = "train_loss") -> dict[int, float]:
    with open(run_dir / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def half_checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{HALF:08d}"


def exact_resume_runs(name: str, overrides: list[str], out: Path, stop: bool = False) -> list[dict]:
    """STEPS steps straight, saving every HALF steps, and a run resumed from step HALF. With `stop`, the
    resumed run instead continues a run that a SIGTERM on rank 1 stopped after saving step HALF."""
    manager = CHECKPOINTS + MANAGER_OPTIONS.get(name, [])
    straight = BASE + overrides + ([] if stop else manager + [f"callbacks.checkpoint.every_n_steps={HALF}"])
    runs = [{"name": f"{name}-straight", "overrides": straight}]
    if stop:
        runs.append({"name": f"{name}-first", "overrides": BASE + overrides + manager + helper("signal", step=HALF, rank=1)})
    saved = half_checkpoint(out / f"{name}-{'first' if stop else 'straight'}")
    runs.append({"name": f"{name}-resumed", "overrides": BASE + overrides + [f"resume={saved}"]})
    return runs


# ---- the batched multi-process launches ---------------------------------------------------------------
_LAUNCHES = POOL.directory("checkpoint")
_ZERO3_SAVED = half_checkpoint(_LAUNCHES / "np4" / "zero3-straight")
POOL.add("checkpoint", 4, [
    *exact_resume_runs("zero3", ZERO3_4, _LAUNCHES / "np4"),
    # one step, then saved at the end (step HALF + 1) for test_a_resharded_run_saves_what_resumes_again
    {"name": "tp_dp-from-zero3", "overrides": BASE + TP_DP + CHECKPOINTS + helper("stop", steps=1) + [
        f"resume={_ZERO3_SAVED}"]},
])
POOL.add("checkpoint", 2, [run for name, overrides in TWO.items()
                           for run in exact_resume_runs(name, overrides, _LAUNCHES / "np2", stop=name == "ddp")])
# reads the 4-process launch's checkpoint: a launch after it
POOL.add("checkpoint", 2, [{"name": "pp-from-zero3", "overrides": BASE + TWO["pp"] + helper("stop", steps=1) + [
    f"resume={_ZERO3_SAVED}"]}], stage=1)


@pytest.fixture(scope="module")
def launches() -> Path:
    POOL.ensure(4, "checkpoint")
    POOL.ensure(2, "checkpoint")
    return POOL.ensure(2, "checkpoint", stage=1)


EXACT = [("np2", name) for name in TWO] + [("np4", "zero3")]


def assert_exact_resume(run_dir: Path, name: str) -> None:
    """The resumed run's per-step losses (and final validation loss) are bitwise the straight run's."""
    straight = column(run_dir / f"{name}-straight")
    resumed = column(run_dir / f"{name}-resumed")
    assert sorted(straight) == list(range(1, STEPS + 1)) and sorted(resumed) == list(range(HALF + 1, STEPS + 1))
    assert [resumed[s] for s in sorted(resumed)] == [straight[s] for s in sorted(resumed)]
    assert column(run_dir / f"{name}-resumed", "val_loss")[STEPS] == column(run_dir / f"{name}-straight", "val_loss")[STEPS]


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "name"), EXACT, ids=[f"{n}-{s}" for n, s in EXACT])
def test_exact_resume_gives_the_same_losses(launches: Path, nproc: str, name: str) -> None:
    assert_exact_resume(launches / nproc, name)


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_and_stops_every_rank(launches: Path) -> None:
    """ddp-first got SIGTERM on rank 1 only, before step HALF: all ranks agreed to save step HALF and stop;
    its resumed run gave the straight run's losses (checked above)."""
    first = launches / "np2" / "ddp-first"
    assert column(first) == {s: column(launches / "np2" / "ddp-straight")[s] for s in range(1, HALF + 1)}
    assert [c.name for c in complete_checkpoints(first / "checkpoints")] == [half_checkpoint(first).name]
    manifest = json.loads((half_checkpoint(first) / "checkpoint.json").read_text())
    assert manifest["reason"] == "signal" and manifest["step"] == HALF and manifest["world_size"] == 2
    log = (first / "train.log").read_text()
    assert "SIGTERM: saving a checkpoint" not in log  # rank 0 was not signalled
    assert "a signal on another rank: saving a checkpoint at step" in log


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "name"), [("np4", "tp_dp"), ("np2", "pp")])
def test_zero3_checkpoint_resumes_under_another_layout(launches: Path, nproc: str, name: str) -> None:
    """Saved by zero3 on 4 ranks; the first step resumed under tp=2 x dp=2 (4 ranks) or pp=2 (2 ranks)
    logs the loss the original run logged at that step."""
    original = column(launches / "np4" / "zero3-straight")
    resumed = column(launches / nproc / f"{name}-from-zero3")
    assert list(resumed) == [HALF + 1]
    assert resumed[HALF + 1] == pytest.approx(original[HALF + 1], rel=1e-4)


@pytest.mark.slow
def test_a_resharded_run_saves_what_resumes_again(launches: Path, tmp_path: Path) -> None:
    """zero3 (4 ranks) -> one step under tp=2 x dp=2 with ZeRO-1 states, saved -> one process: the next two
    losses are the original run's, so the ZeRO-1 states of tensor-parallel shards were saved and loaded
    in the parameters' layout."""
    checkpoint = launches / "np4" / "tp_dp-from-zero3" / "checkpoints" / f"step_{HALF + 1:08d}"
    assert json.loads((checkpoint / "checkpoint.json").read_text())["parallel_dims"]["tp"] == 2
    trainer = build_trainer(compose(BASE + ["trainer.micro_batch_size=8", f"resume={checkpoint}"]), tmp_path)
    trainer.callbacks.append(StopAfterSteps(2))
    trainer.fit()
    original = column(launches / "np4" / "zero3-straight")
    assert column(tmp_path) == pytest.approx({s: original[s] for s in (HALF + 2, HALF + 3)}, rel=1e-4)


@pytest.mark.slow
def test_zero3_checkpoint_resumes_on_a_single_process(launches: Path, tmp_path: Path) -> None:
    checkpoint = half_checkpoint(launches / "np4" / "zero3-straight")
    trainer = build_trainer(compose(BASE + ["trainer.micro_batch_size=8", f"resume={checkpoint}"]), tmp_path)
    assert trainer.step == HALF and trainer.tokens_seen == HALF * 8 * 32
    trainer.callbacks.append(StopAfterSteps(1))
    trainer.fit()
    assert column(tmp_path)[HALF + 1] == pytest.approx(column(launches / "np4" / "zero3-straight")[HALF + 1], rel=1e-4)


@pytest.mark.slow
def test_killed_ranks_restart_from_the_in_memory_replica_or_the_last_complete_checkpoint(
        launches: Path, tmp_path: Path) -> None:
    """One `python -m trainer trainer.max_restarts=3` job (2 ddp ranks), disk checkpoints every 4 steps,
    in-memory snapshots every 3, three faults of rank 1:

    1. at step 7 it loses its shared memory (its own shard and the replica it held) and is SIGKILLed: the
       restart restores the snapshot of step 6 (newer than the disk's step 4) without reading the disk, rank 1
       fetching its shard from rank 0's replica;
    2. it is SIGKILLed while the disk checkpoint of step 8 is being written: that save never completes (the
       next start removes it) and the restart restores the snapshot of step 6 again;
    3. at step 10 both copies of its shard of the step-9 snapshot are lost with the kill: the restart says so
       and resumes from the disk checkpoint of step 8.
    Every loss is the uninterrupted run's, bitwise, and the summary holds the last fault's timeline. Saves
    are synchronous here: fault 3 must find the step-8 checkpoint committed, which an asynchronous save may
    not be two steps later (tests/test_recovery.py kills a rank during an asynchronous write)."""
    command = [sys.executable, "-m", "trainer", *BASE, *TWO["ddp"], *CHECKPOINTS, "callbacks.checkpoint.every_n_steps=4",
               "callbacks.checkpoint.async_save=false",
               "callbacks.checkpoint.in_memory_every=3", "trainer.max_restarts=3", f"hydra.run.dir={tmp_path}",
               *helper("lose", step=7, rank=1, attempt=0, lose="own"),
               *helper("kill_save", step=8, rank=1, attempt=1),
               *helper("lose_both", step=10, rank=1, attempt=2, lose="both")]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    checkpoints = tmp_path / "checkpoints"
    from trainer.checkpoint.memory import snapshot_root

    assert f"resumed from the in-memory snapshot of step 6 in {snapshot_root(tmp_path)} (restart 1)" in log
    assert "in-memory snapshot of step 6: fetched __0_0.distcp from rank 0, __1_0.distcp from rank 0" in result.stdout
    assert f"resumed from the in-memory snapshot of step 6 in {snapshot_root(tmp_path)} (restart 2)" in log
    assert f"removed an incomplete save (a process stopped while writing it): {checkpoints / '.step_00000008.partial'}" in log
    assert ("in-memory snapshot of step 9 lost: the shard(s) of rank(s) [1] have neither their own copy nor their "
            "replica; resuming from the newest disk checkpoint instead") in log
    assert f"resumed from {checkpoints / 'step_00000008'} at step 8 (restart 3)" in log
    reference = column(launches / "np2" / "ddp-straight")
    resumed = column(tmp_path)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in range(1, STEPS + 1)] == [reference[s] for s in range(1, STEPS + 1)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["final_train_loss"] == reference[STEPS]
    assert latest_complete_checkpoint(checkpoints).name == f"step_{STEPS:08d}"
    timeline = summary["recovery"]
    assert timeline["restart"] == 3 and timeline["resumed_step"] == 8 and timeline["first_step_after_fault"] == 9
    # rank 0 reached step 10 (rank 1 was killed at its end) or, if killed first, step 9
    assert timeline["last_step_before_fault"] in (9, 10)
    assert timeline["steps_lost"] == timeline["last_step_before_fault"] - 8
    assert timeline["detected"] < timeline["worker_started"] < timeline["restore_started"] < timeline["first_step_end"]
    assert not snapshot_root(tmp_path).exists()  # removed at the normal end


# ---- one process ------------------------------------------------------------------------------------------
SINGLE = ["trainer.micro_batch_size=4"]


@pytest.fixture(scope="module")
def single_straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("single-straight")
    build_trainer(compose(BASE + SINGLE), run_dir).fit()
    return column(run_dir)


@pytest.mark.parametrize(("callbacks", "signum"), [(CHECKPOINTS, "SIGTERM"), (["callbacks=none"], "SIGUSR1")],
                         ids=["manager-sigterm", "no-callbacks-sigusr1"])
def test_single_process_signal_saves_stops_and_resume_auto_continues_exactly(
        tmp_path: Path, single_straight: dict[int, float], callbacks: list[str], signum: str) -> None:
    """The loop owns the preemption signals (trainer/preemption.py) whatever the callbacks: with the manager
    the save is one of its checkpoints, without one it goes to <run_dir>/checkpoints the same way."""
    first = build_trainer(compose(BASE + SINGLE + callbacks + helper("signal", step=HALF, signum=signum)), tmp_path)
    with pytest.raises(TrainingPreempted, match=f"preempted by {signum} at step {HALF}: checkpoint .*step_{HALF:08d}"):
        first.fit()
    assert first.step == HALF and first.preempted_by == signum
    assert [c.name for c in complete_checkpoints(tmp_path / "checkpoints")] == [half_checkpoint(tmp_path).name]
    assert json.loads((half_checkpoint(tmp_path) / "checkpoint.json").read_text())["reason"] == "signal"
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):  # the loop put the handlers back
        assert signal.getsignal(number) in (signal.SIG_DFL, signal.default_int_handler)
    assert sorted(column(tmp_path)) == list(range(1, HALF + 1))
    assert sorted(column(tmp_path, "val_loss")) == [HALF]  # the step's scheduled validation ran before the stop
    # resume=auto (the default) in the same run directory picks the checkpoint up
    resumed = build_trainer(compose(BASE + SINGLE), tmp_path)
    assert resumed.step == HALF and resumed.tokens_seen == HALF * 8 * 32
    resumed.fit()
    # metrics.csv continues: the whole curve, each step once, validation of both runs included
    losses = column(tmp_path)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert [losses[s] for s in range(1, STEPS + 1)] == [single_straight[s] for s in range(1, STEPS + 1)]
    assert sorted(column(tmp_path, "val_loss")) == [HALF, STEPS]
    with open(tmp_path / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")] == list(range(1, STEPS + 1))


def test_a_repeated_signal_within_the_window_is_one_notice_a_later_one_acts_as_usual(
        monkeypatch: pytest.MonkeyPatch) -> None:
    watched = PreemptionSignals(["SIGUSR1"])
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: seen.append(number))
    try:
        watched.install()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # the terminal's and the launcher's copy of one Ctrl-C
        assert watched.received == signal.SIGUSR1 and seen == []
        clock = time.monotonic() + 10.0
        monkeypatch.setattr("trainer.preemption.time.monotonic", lambda: clock)
        os.kill(os.getpid(), signal.SIGUSR1)  # later: the handler before ours takes it
        assert seen == [signal.SIGUSR1]
        watched.restore()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_an_exception_saves_the_state_and_the_run_resumes_from_it(
        tmp_path: Path, single_straight: dict[int, float]) -> None:
    failing = build_trainer(compose(BASE + SINGLE + CHECKPOINTS + helper("fail", step=6)), tmp_path)
    with pytest.raises(RuntimeError, match="injected failure at step 6"):
        failing.fit()
    checkpoint = latest_complete_checkpoint(tmp_path / "checkpoints")
    assert checkpoint is not None and checkpoint.name == "step_00000006"
    assert json.loads((checkpoint / "checkpoint.json").read_text())["reason"] == "exception"
    resumed = build_trainer(compose(BASE + SINGLE), tmp_path)
    resumed.callbacks.append(StopAfterSteps(4))
    resumed.fit()
    assert column(tmp_path) == {s: single_straight[s] for s in range(1, 11)}


@pytest.fixture(scope="module")
def two_checkpoints_once(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("two-checkpoints")
    trainer = build_trainer(compose(BASE + SINGLE + CHECKPOINTS + ["callbacks.checkpoint.every_n_steps=4"]), run_dir)
    trainer.callbacks.append(StopAfterSteps(8))
    trainer.fit()
    assert [c.name for c in complete_checkpoints(run_dir / "checkpoints")] == ["step_00000004", "step_00000008"]
    return run_dir


@pytest.fixture
def two_checkpoints(two_checkpoints_once: Path, tmp_path: Path) -> Path:
    """A run directory of its own with complete checkpoints at steps 4 and 8."""
    shutil.copytree(two_checkpoints_once, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_shard_is_named_and_resume_auto_falls_back(two_checkpoints: Path, damage: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    latest = two_checkpoints / "checkpoints" / "step_00000008"
    shard = latest / "__0_0.distcp"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        shard.unlink()
    trainer = build_trainer(compose(BASE + SINGLE + ["resume=none"]), two_checkpoints / "other")
    expected = {"truncate": "is truncated", "flip": "does not match the CRC-32", "delete": "is missing"}[damage]
    with pytest.raises(CheckpointCorruptError, match=expected) as error:
        load_checkpoint(trainer, latest)
    assert str(shard) in str(error.value) and error.value.file == shard
    with caplog.at_level("WARNING", logger="trainer"):
        resumed = build_trainer(compose(BASE + SINGLE), two_checkpoints)
    assert resumed.step == 4
    assert "falling back to the previous complete checkpoint" in caplog.text and str(shard) in caplog.text


def test_a_damaged_checkpoint_given_explicitly_fails_clearly(two_checkpoints: Path) -> None:
    latest = two_checkpoints / "checkpoints" / "step_00000008"
    (latest / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="__0_0.distcp is truncated"):
        build_trainer(compose(BASE + SINGLE + [f"resume={latest}"]), two_checkpoints / "other")


def test_a_save_that_never_committed_is_ignored_and_cleaned_up(two_checkpoints: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.checkpoint.manifest as manifest

    trainer = build_trainer(compose(BASE + SINGLE + ["resume=none"]), two_checkpoints / "other")
    real_replace = os.replace

    def crash_before_rename(src: Any, dst: Any) -> None:
        if str(src).endswith(".partial"):
            raise OSError("simulated crash before the commit")
        real_replace(src, dst)

    monkeypatch.setattr(manifest.os, "replace", crash_before_rename)
    with pytest.raises(Exception, match="simulated crash"):
        save_checkpoint(trainer, two_checkpoints / "checkpoints" / "step_00000012")
    monkeypatch.undo()
    partial = two_checkpoints / "checkpoints" / ".step_00000012.partial"
    assert (partial / ".metadata").is_file()  # every shard was written, only the commit is missing
    assert latest_complete_checkpoint(two_checkpoints / "checkpoints").name == "step_00000008"
    resumed = build_trainer(compose(BASE + SINGLE + CHECKPOINTS), two_checkpoints)
    assert resumed.step == 8
    resumed.callbacks.append(StopAfterSteps(0))
    resumed.fit()  # the manager's start removes what the interrupted save left
    assert not partial.exists()


def test_resume_refuses_a_checkpoint_of_another_model(two_checkpoints: Path) -> None:
    from trainer.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="saved for another model: model.dim=64 vs 32"):
        build_trainer(compose(BASE + SINGLE + ["model.dim=32"]), two_checkpoints)


def test_resume_and_init_from_are_validated_before_launch(tmp_path: Path) -> None:
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match="resume: .* does not exist"):
        validate(compose(BASE + [f"resume={tmp_path / 'nope'}"]))
    with pytest.raises(ConfigError, match="init_from: .* neither a checkpoint"):
        validate(compose(BASE + [f"init_from={tmp_path}"]))
    with pytest.raises(ConfigError, match="callbacks.checkpoint: keep_last must be >= 1"):
        validate(compose(BASE + CHECKPOINTS + ["callbacks.checkpoint.keep_last=0"]))


def test_parameter_names_ignore_wrappers() -> None:
    """Optimizer states are named like get_model_state_dict names the weights, through activation
    checkpointing (and torch.compile's module wrapper) attributes."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from trainer.checkpoint.state import canonical_name

    model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2))
    names = [canonical_name(name, model) for name, _ in model.named_parameters()]
    assert names == list(get_model_state_dict(model)) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert canonical_name("layers.0._orig_mod.attention.wq.weight", model) == "layers.0.attention.wq.weight"


def test_retention_keeps_the_last_the_best_and_the_milestones() -> None:
    policy = RetentionPolicy(keep_last=2, keep_best=2, monitor="val_loss", mode="min", milestone_every=30)
    losses = {10: 3.0, 20: 2.0, 30: 2.5, 40: 1.5, 50: 1.9, 60: 2.2, 70: 2.4}
    entries = [(step, Path(f"step_{step}"), {"val_loss": loss}) for step, loss in losses.items()]
    entries.append((80, Path("step_80"), {}))  # not validated (yet)
    kept = {int(p.name.split("_")[1]) for p in policy.keep(entries)}
    assert kept == {70, 80} | {40, 50} | {30, 60}


class SlowCopy(DefaultStager):
    """A background stager whose copy to host memory starts 1 s late: the next step's optimizer step (its
    forward and backward take milliseconds) would change the weights before they are copied unless the loop
    waits for the copy."""

    def _stage(self, state_dict: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return super()._stage(state_dict, **kwargs)


def test_a_background_copy_holds_the_saved_step_and_the_loop_waits_for_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Asynchronous saves copy the state in the background (trainer.checkpoint.io.background_stager) while
    the next step computes; its optimizer step waits for the copy. The checkpoint of step 4 then resumes to the
    uninterrupted run's losses bitwise, and each asynchronous save's stall counts the wait."""
    import trainer.plugins.callbacks.checkpoint as manager_module

    monkeypatch.setattr(manager_module, "background_stager",
                        lambda device_type: SlowCopy(StagingOptions(False, False, True, False)))
    steps = ["trainer.max_steps=8", "trainer.val_every=0", "callbacks.checkpoint.every_n_steps=4",
             "callbacks.checkpoint.keep_last=3"]
    straight = build_trainer(compose(BASE + SINGLE + CHECKPOINTS + steps), tmp_path / "straight")
    summary = straight.fit()
    saves = summary["checkpoints"]["saves"]
    assert [(s["step"], s["asynchronous"]) for s in saves] == [(4, True), (8, True)]
    # the step after the save waited for the late copy (what its forward and backward took is not waited;
    # 0.5 s of margin for a loaded machine)
    assert saves[0]["wait_s"] >= 0.5, saves
    resumed_dir = tmp_path / "resumed"
    resumed = build_trainer(compose(BASE + SINGLE + CHECKPOINTS + steps + [
        f"resume={tmp_path / 'straight' / 'checkpoints' / 'step_00000004'}"]), resumed_dir)
    resumed.fit()
    expected = {step: loss for step, loss in column(tmp_path / "straight").items() if step > 4}
    assert column(resumed_dir) == expected and len(expected) == 4


def test_manager_saves_on_time_and_steps_and_prunes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    import trainer.plugins.callbacks.checkpoint as manager_module

    clock = [0.0]
    monkeypatch.setattr(manager_module.time, "monotonic", lambda: clock[0])

    class Clock(Callback):
        def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
            clock[0] += 25.0  # every step "takes" 25 s: a 1-minute timer expires on the third step

    # saves: timed at 3 and 8, periodic at 5 and 10, at the end 12; validation at 3, 6, 9, 12
    options = ["callbacks.checkpoint.every_n_steps=5", "callbacks.checkpoint.every_n_minutes=1",
               "callbacks.checkpoint.keep_last=2", "callbacks.checkpoint.keep_best=1",
               "callbacks.checkpoint.monitor=val_loss", "callbacks.checkpoint.mode=max",
               "callbacks.checkpoint.milestone_every=10", "trainer.val_every=3"]
    trainer = build_trainer(compose(BASE + SINGLE + CHECKPOINTS + options), tmp_path)
    trainer.callbacks.insert(0, Clock())
    trainer.callbacks.append(StopAfterSteps(12))
    with caplog.at_level("INFO", logger="trainer"):
        trainer.fit()
    saved = [int(line.split("step_")[1][:8]) for line in caplog.messages if line.startswith("checkpoint saved")]
    removed = [int(line.split("step_")[1][:8]) for line in caplog.messages if "retention policy" in line]
    assert saved == [3, 5, 8, 10, 12] and sorted(removed) == [5, 8]
    # periodic and timed saves are asynchronous (the default), the end save synchronous; one line per save
    # says what it cost the loop, and summary.json gets every save's figures
    kinds = [re.search(r"\((\w+), (\w+)\): the loop stalled \d+\.\d\d s", line).groups()
             for line in caplog.messages if line.startswith("checkpoint saved")]
    assert kinds == [("timed", "asynchronous"), ("periodic", "asynchronous"), ("timed", "asynchronous"),
                     ("periodic", "asynchronous"), ("end", "synchronous")]
    figures = trainer.summary(0.0)["checkpoints"]
    assert [(s["step"], s["reason"], s["asynchronous"]) for s in figures["saves"]] == [
        (3, "timed", True), (5, "periodic", True), (8, "timed", True), (10, "periodic", True), (12, "end", False)]
    assert all(s["write_s"] is not None for s in figures["saves"] if s["asynchronous"])
    assert figures["asynchronous"]["saves"] == 4 and figures["synchronous"]["saves"] == 1
    manifests = {int(p.name[5:]): json.loads((p / "checkpoint.json").read_text())
                 for p in complete_checkpoints(tmp_path / "checkpoints")}
    # kept: the last two (10, 12), the worst validation loss (mode=max: step 3, validated after its
    # save), the milestone (10)
    assert sorted(manifests) == [3, 10, 12]
    assert [manifests[s]["reason"] for s in (3, 10, 12)] == ["timed", "periodic", "end"]
    val = column(tmp_path, "val_loss")
    assert manifests[3]["metrics"]["val_loss"] == val[3] > val[12] == manifests[12]["metrics"]["val_loss"]


def test_checkpoint_loading_refuses_code_in_metadata_and_values(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer.checkpoint.storage import SafeFileSystemReader, WeightsOnlyLoadPlanner

    class Payload:
        def __reduce__(self) -> tuple:
            return (print, ("this must never run",))

    with pytest.warns(UserWarning):
        dcp.save({"x": torch.ones(2), "payload": Payload()}, checkpoint_id=tmp_path / "values", no_dist=True)
    state = {"x": torch.zeros(2), "payload": None}
    with pytest.warns(UserWarning), pytest.raises(CheckpointException) as error:
        dcp.load(state, storage_reader=SafeFileSystemReader(tmp_path / "values"), planner=WeightsOnlyLoadPlanner(),
                 no_dist=True)
    assert "Weights only load failed" in str(error.value.failures[0]) and state["payload"] is None
    metadata = tmp_path / "values" / ".metadata"
    metadata.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(UnsafeCheckpointError, match="refusing to load builtins.print"):
        read_metadata(metadata.parent)


# ---- a full disk (a fake one: shutil.disk_usage and DCP's writes are patched; no tmpfs here) -----------------
class FullDiskAtStep(Callback):
    """From step `step` on, the disk of the checkpoint directory reports `free` bytes (before a save), or
    (`enospc`) the writes of the save fail with ENOSPC after the first file's write began."""

    def __init__(self, step: int, free: int = 1000, enospc: bool = False) -> None:
        self.step, self.free, self.enospc = step, free, enospc

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.step != self.step:
            return
        from torch.distributed.checkpoint import filesystem

        import trainer.checkpoint.space as space

        if self.enospc:
            original = filesystem._write_item

            def write_item(*args: Any, **kwargs: Any) -> Any:
                original(*args, **kwargs)  # part of the checkpoint is on disk, then the disk is full
                raise OSError(errno.ENOSPC, "No space left on device")

            filesystem._write_item = write_item
        else:
            usage = space.shutil.disk_usage
            space.shutil = type("FakeShutil", (), {"disk_usage": staticmethod(
                lambda path: usage(path)._replace(free=self.free))})
        PATCHED.append(self.enospc)


PATCHED: list[bool] = []
HELPERS["full_disk"] = FullDiskAtStep


@pytest.fixture
def restore_disk() -> Any:
    from torch.distributed.checkpoint import filesystem

    import trainer.checkpoint.space as space

    write_item, real_shutil = filesystem._write_item, space.shutil
    yield
    filesystem._write_item, space.shutil = write_item, real_shutil
    PATCHED.clear()


@pytest.mark.parametrize("enospc", [False, True], ids=["refused-before", "enospc-during"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_which_disk_and_sizes(
        tmp_path: Path, single_straight: dict[int, float], restore_disk: Any, enospc: bool) -> None:
    """Saves every HALF steps; the disk is full before the save of step STEPS: refused with the sizes before
    anything is written, or ENOSPC while writing (the partial save removed). The checkpoint of step HALF
    stays and resume=auto continues from it exactly, metrics.csv holding each step once."""
    overrides = BASE + SINGLE + CHECKPOINTS + [f"callbacks.checkpoint.every_n_steps={HALF}"]
    failing = build_trainer(compose(overrides + helper("full_disk", step=STEPS - 1, enospc=enospc)), tmp_path)
    with pytest.raises(CheckpointNoSpaceError) as raised:
        failing.fit()
    assert PATCHED == [enospc]
    message = str(raised.value)
    assert "\n" not in message
    mount = re.escape(str(space_disk_of(tmp_path)))
    if enospc:
        assert re.fullmatch(rf"no space left on {mount} while writing the checkpoint of step {STEPS} \(\d+\.\d [kMG]B "
                            rf"expected, .* free after removing the partial save \.step_{STEPS:08d}\.partial\); the last "
                            rf"complete checkpoint .*step_{HALF:08d} is kept", message), message
    else:
        assert re.fullmatch(rf"the checkpoint of step {STEPS} needs \d+\.\d [kMG]B, 1\.0 kB free on {mount} "
                            rf"\({re.escape(str(tmp_path / 'checkpoints'))}\): free some space or point the checkpoint "
                            "directory at another disk", message), message
    # the previous checkpoint is kept, nothing partial is left behind
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [half_checkpoint(tmp_path).name]
    failing = None
    resumed = build_trainer(compose(BASE + SINGLE), tmp_path)
    assert resumed.step == HALF
    resumed.fit()
    losses = column(tmp_path)
    with open(tmp_path / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")] == list(range(1, STEPS + 1))
    assert [losses[s] for s in range(1, STEPS + 1)] == [single_straight[s] for s in range(1, STEPS + 1)]


def space_disk_of(path: Path) -> Path:
    from trainer.checkpoint.space import disk_of

    return disk_of(path)[0]
