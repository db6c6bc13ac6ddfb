"""Hydra multirun sweeps: multi-process jobs, a failing job that does not stop the sweep, the summary,
planner-based skipping, and the ready Optuna sweeper / submitit launcher configs."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.sweep import JobResult, format_table, swept_keys

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
         "trainer.seq_len=32", "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.max_steps=3",
         "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=1",
         "data.max_bytes=1000000",
         # a fixed MFU reference: each process would otherwise spend seconds measuring its matmul peak
         "trainer.peak_flops=1e11"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# Four experiments in a config group of the test's own (like recipes): two single-process runs, a DDP
# and a ZeRO-2 run of 2 processes each; rank 1 of the ZeRO-2 run raises at step 2.
CASES = {
    "a_single": "optimizer:\n  lr: 1.0e-3\n",
    "b_ddp2": "defaults:\n  - override /strategy: ddp\noptimizer:\n  lr: 1.0e-3\ntrainer:\n  devices: 2\n",
    "c_zero2_fails": ("defaults:\n  - override /strategy: zero2\ntrainer:\n  devices: 2\ncallbacks:\n  fail:\n"
                      "    _target_: tests.helpers.FailOnRank\n    rank: 1\n    step: 2\n"),
    "d_single_lr": "optimizer:\n  lr: 3.0e-4\n",
}


def python(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=timeout)


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.beside
def test_four_job_sweep_with_multiprocess_jobs_survives_a_failing_job_and_is_summarized(tmp_path: Path) -> None:
    case_dir = tmp_path / "conf" / "case"
    case_dir.mkdir(parents=True)
    for name, body in CASES.items():
        (case_dir / f"{name}.yaml").write_text(f"# @package _global_\n{body}")
    sweep = tmp_path / "sweep"
    result = python("-m", "trainer", "-m", *SMALL, f"+case={','.join(CASES)}",
                    f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"hydra.sweep.dir={sweep}",
                    # profile step 2 of every job for its communication time
                    "callbacks.throughput.comm_every=2")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "4 jobs: 3 ok, 1 failed" in result.stdout, out[-3000:]  # printed when the sweep ended

    summary = python("-m", "trainer.sweep", "summarize", str(sweep), "--csv", str(tmp_path / "table.csv"))
    assert summary.returncode == 0, summary.stderr
    assert "4 jobs: 3 ok, 1 failed" in summary.stdout
    rows = {row["+case"]: row for row in read_csv(tmp_path / "table.csv")}
    assert list(rows) == list(CASES)
    assert read_csv(sweep / "summary.csv") == list(rows.values())  # the one written when the sweep ended
    assert {name: row["status"] for name, row in rows.items()} == {
        "a_single": "ok", "b_ddp2": "ok", "c_zero2_fails": "failed", "d_single_lr": "ok"}

    failed = rows["c_zero2_fails"]
    assert "rank 1 failed" in failed["error"] and "injected failure on rank 1 at step 2" in failed["error"]
    assert failed["final_val_loss"] == failed["tokens_per_s"] == failed["peak_memory_mib"] == ""
    assert "+case=c_zero2_fails" in failed["overrides"] and "trainer.max_steps=3" in failed["overrides"]
    table_line = next(line for line in summary.stdout.splitlines() if "c_zero2_fails" in line)
    assert table_line.split()[:3] == [failed["job"], "c_zero2_fails", "failed"] and "rank 1 failed" in table_line

    for name in ("a_single", "b_ddp2", "d_single_lr"):
        row = rows[name]
        assert row["error"] == ""
        assert math.isfinite(float(row["final_val_loss"])) and float(row["tokens_per_s"]) > 0
        assert float(row["peak_memory_mib"]) > 0
        job = sweep / row["job"]
        job_summary = json.loads((job / "summary.json").read_text())
        assert float(row["final_val_loss"]) == pytest.approx(job_summary["final_val_loss"], rel=1e-5)
        assert float(row["peak_memory_mib"]) == pytest.approx(
            max(job_summary["peak_memory_bytes_per_rank"]) / 2**20, abs=0.06)
        assert job_summary["world_size"] == (2 if name == "b_ddp2" else 1)
    # each job is a full run: DDP over 2 processes reproduces the single-process run with the same lr
    assert float(rows["b_ddp2"]["final_val_loss"]) == pytest.approx(float(rows["a_single"]["final_val_loss"]),
                                                                     rel=1e-4)
    assert rows["d_single_lr"]["final_val_loss"] != rows["a_single"]["final_val_loss"]
    assert not (sweep / rows["c_zero2_fails"]["job"] / "summary.json").exists()

    # the profiled step: the 2-process job had collectives in flight, the single-process job none
    comm = {name: [float(r["comm_s"]) for r in read_csv(sweep / rows[name]["job"] / "metrics.csv") if r.get("comm_s")]
            for name in ("a_single", "b_ddp2")}
    assert comm["a_single"] == [0.0]
    assert len(comm["b_ddp2"]) == 1 and comm["b_ddp2"][0] > 0


@pytest.mark.slow
@pytest.mark.beside
def test_jobs_the_planner_says_do_not_fit_are_skipped_before_launch(tmp_path: Path) -> None:
    """With sweep.skip_unfit=true a job the planner rejects does not run and is `skipped_unfit`."""
    sweep = tmp_path / "sweep"
    # dim 8192 gives ~540M parameters: ~8.6 GB of fp32 weights, gradients and Adam states, more than a
    # `hardware=cpu` device's 3 GB; dim 64 fits and runs.
    result = python("-m", "trainer", "-m", *SMALL, "trainer.max_steps=2", "model.dim=64,8192", "hardware=cpu",
                    "sweep.skip_unfit=true", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "2 jobs: 1 ok, 1 skipped_unfit" in result.stdout
    rows = {row["model.dim"]: row for row in read_csv(sweep / "summary.csv")}
    assert rows["64"]["status"] == "ok" and float(rows["64"]["tokens_per_s"]) > 0
    skipped = rows["8192"]
    assert skipped["status"] == "skipped_unfit"
    assert "does not fit" in skipped["error"] and "device memory" in skipped["error"]
    job = sweep / skipped["job"]
    assert not (job / "metrics.csv").exists() and not (job / "summary.json").exists()
    assert "skipped: the planner says it does not fit" in (job / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.beside
def test_optuna_sweeper_on_the_submitit_local_launcher(tmp_path: Path) -> None:
    """The ready configs: one Optuna trial, run as a submitit job in its own process."""
    sweep = tmp_path / "sweep"
    result = python("-m", "trainer", "-m", *SMALL, "hydra/sweeper=optuna_lr", "hydra/launcher=local",
                    "hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert list((sweep / ".submitit").iterdir()), "the job did not go through submitit"
    job_summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert json.loads((sweep / "0" / "status.json").read_text())["status"] == "ok"
    optimized = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    # the objective Optuna saw is the job's final val_loss
    assert optimized["best_value"] == pytest.approx(job_summary["final_val_loss"])
    lr = optimized["best_params"]["optimizer.lr"]
    assert 1e-4 <= lr <= 1e-2
    assert yaml.safe_load((sweep / "0" / "config.yaml").read_text())["optimizer"]["lr"] == pytest.approx(lr)


def test_summary_table_shows_only_the_swept_keys() -> None:
    jobs = [JobResult("0", ["trainer.max_steps=3", "optimizer.lr=1e-3"], "ok", final_val_loss=2.5,
                      tokens_per_s=1000.0, peak_memory_bytes_per_rank=[2**30, 2**29]),
            JobResult("1", ["trainer.max_steps=3", "optimizer.lr=3e-4", "+extra=1"], "failed", error="x" * 200)]
    assert swept_keys(jobs) == ["optimizer.lr", "+extra"]
    lines = format_table(jobs).splitlines()
    assert lines[0].split() == ["job", "optimizer.lr", "+extra", "val_loss", "tokens/s", "peak", "MiB", "status",
                                "error"]
    assert lines[2].split()[:7] == ["0", "1e-3", "-", "2.5000", "1,000", "1,024", "ok"]
    assert lines[3].endswith("x" * 77 + "...")
    assert lines[-1] == "2 jobs: 1 ok, 1 failed"
