"""Crash consistency: a run SIGKILLed during training, during a checkpoint commit or in the middle of writing
metrics.csv, then continued with resume=auto, ends with the same metrics.csv (every step once) and the same
losses as a run that was never interrupted.

SIGKILL runs no handler and flushes nothing (a lost node, the OOM killer), so the killed runs are real
`python -m trainer` processes (tests.helpers.KillSelf kills its own process at the chosen point); the
uninterrupted reference and the final resumes run in this process.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.checkpoint.manifest import complete_checkpoints
from trainer.config import compose
from trainer.run import train

REPO = Path(__file__).resolve().parent.parent
# The run of issue 15's first report: 20 steps, a checkpoint every 5, every step logged.
RUN = [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
    "trainer.seq_len=64", "trainer.micro_batch_size=4", "trainer.global_batch_size=8", "trainer.max_steps=20",
    "trainer.val_batches=2", "trainer.log_every=1", "trainer.val_every=0", "lr_schedule.warmup_steps=2",
    "data.max_bytes=2000000", "callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=5",
    "+callbacks.kill._target_=tests.helpers.KillSelf",
    "trainer.peak_flops=1e11",  # no matmul measurement at start-up: MFU is not compared
]
COMPARED = ("train_loss", "lr", "grad_norm", "tokens", "val_loss")


def _kill_overrides(step: int, phase: str) -> list[str]:
    return [f"+callbacks.kill.step={step}", f"+callbacks.kill.phase={phase}"]


def _killed_run(run_dir: Path, step: int, phase: str) -> None:
    """`python -m trainer` in run_dir (resume=auto), killed by SIGKILL at (step, phase)."""
    result = subprocess.run([sys.executable, "-m", "trainer", *RUN, *_kill_overrides(step, phase),
                             f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-2000:]


def _finish(run_dir: Path) -> list[dict[str, str]]:
    """resume=auto to the end, in this process (step 0 never fires the kill); the rows of metrics.csv."""
    train(compose(RUN + _kill_overrides(0, "step")), run_dir)
    return _rows(run_dir)


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _record(rows: list[dict[str, str]]) -> list[tuple]:
    return [(int(r["step"]), *(r.get(k) or None for k in COMPARED)) for r in rows]


@pytest.mark.slow
@pytest.mark.beside
def test_sigkill_during_metrics_writing_commit_and_training_then_resume_matches_an_uninterrupted_run(
        tmp_path: Path) -> None:
    """One run directory, three kills, each followed by resume=auto (the next launch, then the last resume
    in this process): metrics.csv and the losses end up exactly those of the uninterrupted run."""
    reference = _record(_finish(tmp_path / "reference"))
    assert [row[0] for row in reference] == list(range(1, 21)) and reference[-1][-1] is not None
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"

    # 1. Killed in the middle of appending rows 6-10 to metrics.csv (the flush before the step-10 checkpoint):
    #    a torn last line, and only the step-5 checkpoint.
    _killed_run(run, 10, "metrics")
    assert not (run / "metrics.csv").read_text().endswith("\n"), "the kill left a torn last line"
    assert [p.name for p in complete_checkpoints(checkpoints)] == ["step_00000005"]

    # 2. resume=auto from step 5 (the torn line and rows 6-9 are dropped and redone), killed while committing
    #    the step-15 checkpoint: shards and manifest written, the rename that publishes it not done.
    _killed_run(run, 15, "commit")
    assert (checkpoints / ".step_00000015.partial" / "checkpoint.json").is_file()
    assert [p.name for p in complete_checkpoints(checkpoints)][-1] == "step_00000010"

    # 3. resume=auto from step 10 (the unfinished save is removed), killed right after the step-15 checkpoint
    #    (issue 15, case 1): every step up to the checkpoint is on disk with it, each once.
    _killed_run(run, 15, "step")
    assert not (checkpoints / ".step_00000015.partial").exists()
    assert [int(r["step"]) for r in _rows(run)] == list(range(1, 16))

    # The last resume=auto, in this process: the whole record is the uninterrupted run's.
    assert _record(_finish(run)) == reference
    assert [p.name for p in complete_checkpoints(checkpoints)][-1] == "step_00000020"
