"""Preemption, Ctrl-C and full disks through the CLI (issue 33): what a scheduler or a job wrapper sees.

- a preemption signal (SIGTERM, SIGINT, SIGUSR1), whatever the callbacks: a checkpoint at the next step
  boundary, metrics flushed, status.json `preempted` with the step, one line, exit status 75 (EX_TEMPFAIL);
  with `trainer.devices=2` the launcher forwards the signal and ends in seconds without a traceback;
- a full disk: one line naming the disk and the sizes, status.json `no_space`, exit status 5, the previous
  checkpoint kept.

The loop-level behaviour (exact resume after a signal, the refused and the ENOSPC save) is tested in one
process in tests/test_checkpoint.py; these are the few subprocess runs that check the CLI around it.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainer.callback import Callback

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
        "trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.log_every=1",
        "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "data.max_bytes=200000",
        "trainer.peak_flops=1e12", "trainer.num_threads=1", "callbacks=none"]


class MarkStep(Callback):
    """Writes <run_dir>/at_step_N (rank 0) when step N ends, so a test knows when to send its signal."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.step == self.step and trainer.is_global_zero:
            (Path(trainer.run_dir) / f"at_step_{self.step}").touch()


def logged_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train_loss")]


def trainer_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *TINY, *overrides, f"hydra.run.dir={run_dir}"]


@pytest.mark.slow
@pytest.mark.beside
def test_ctrl_c_of_a_launched_run_saves_ends_in_seconds_with_status_75_and_resume_continues(tmp_path: Path) -> None:
    """SIGINT to the launcher of 2 ddp workers (Ctrl-C): forwarded, the workers agree, save and return; the
    launcher ends without waiting out the elastic agent's 30 s grace, one line, no traceback, exit 75,
    status.json `preempted`; resume=auto in the directory finishes the run with each step logged once."""
    run_dir = tmp_path / "run"
    two = ["strategy=ddp", "trainer.devices=2"]
    process = subprocess.Popen(trainer_command(run_dir, *two, "trainer.max_steps=400", "+callbacks.mark._target_="
                                               "tests.test_preemption.MarkStep", "+callbacks.mark.step=3"),
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "at_step_3").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (run_dir / "at_step_3").exists(), process.communicate(timeout=60)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 75, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    # the workers returned: the agent did not SIGTERM them and wait out its 30 s grace (which it logs as
    # "Unable to shutdown process ... forcefully exiting via Signals.SIGKILL", seen before this was built)
    assert "Unable to shutdown process" not in (run_dir / "launcher.log").read_text()
    (line,) = stderr.strip().splitlines()[-1:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "preempted" and status["signal"] == "SIGINT", status
    step = status["step"]
    assert 3 <= step < 400 and line == status["error"]
    assert line.startswith(f"preempted by SIGINT at step {step}: checkpoint ") and "resume=auto" in line
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{step:08d}"]
    assert logged_steps(run_dir) == list(range(1, step + 1))
    # resume=auto continues from the saved step to the end (now a few steps past it)
    end = step + 2
    result = subprocess.run(trainer_command(run_dir, *two, f"trainer.max_steps={end}"), cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert logged_steps(run_dir) == list(range(1, end + 1))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "ok"


@pytest.mark.slow
@pytest.mark.beside
def test_sigterm_of_a_single_process_run_and_a_full_disk_each_end_with_one_line_and_their_status(
        tmp_path: Path) -> None:
    """One process, the default callbacks (no checkpoint manager): SIGTERM before step 3 -> exit 75,
    status.json preempted at step 3, the checkpoint in <run_dir>/checkpoints. Then the same directory with
    a disk that has 1 kB free before the final save: exit 5, one line with the sizes, status.json no_space,
    the step-3 checkpoint kept."""
    run_dir = tmp_path / "run"
    signalled = subprocess.run(trainer_command(run_dir, "trainer.max_steps=6", "+callbacks.signal._target_="
                                               "tests.test_checkpoint.SignalAtStep", "+callbacks.signal.step=3"),
                               cwd=REPO, capture_output=True, text=True, timeout=300)
    assert signalled.returncode == 75, signalled.stderr[-3000:]
    assert "Traceback" not in signalled.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "preempted" and status["step"] == 3 and status["signal"] == "SIGTERM"
    assert signalled.stderr.strip().splitlines()[-1] == status["error"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert logged_steps(run_dir) == [1, 2, 3]

    full = subprocess.run(trainer_command(run_dir, "trainer.max_steps=6", "+callbacks.full._target_="
                                          "tests.test_checkpoint.FullDiskAtStep", "+callbacks.full.step=5"),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert full.returncode == 5, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    (line,) = full.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: the checkpoint of step 6 needs ") and ", 1.0 kB free on " in line, line
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "no_space" and status["error"] == line.removeprefix("error: ")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]
