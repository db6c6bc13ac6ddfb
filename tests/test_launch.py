"""Launching: local workers from a plain `python -m trainer`, joining torchrun, two nodes, failures."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

from tests.launch_pool import POOL

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128",
         "trainer.seq_len=32", "trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.max_steps=4",
         "trainer.log_every=1", "trainer.val_every=2", "trainer.val_batches=1", "lr_schedule.warmup_steps=1",
         "data.max_bytes=1000000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True, scope="module")
def _quiet_machine() -> None:
    """Rendezvous of real launchers: not beside the session's shared launches (one timed out beside them)."""
    POOL.wait_all()


def trainer_cli(*args: str, cwd: Path = REPO, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainer", *SMALL, *args], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=timeout)


def free_port() -> int:
    """A port free now and below the ephemeral range (32768-60999 on Linux): a port the kernel handed out
    (bind to 0) can be handed again to another process's connection before the test's store binds it."""
    for port in random.sample(range(20000, 32768), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def test_devices_2_launches_workers_in_one_run_dir_and_only_rank0_speaks(tmp_path: Path) -> None:
    result = trainer_cli("strategy=ddp", "trainer.devices=2", f"hydra.run.dir={tmp_path}",
                         "+callbacks.pids._target_=tests.helpers.RecordPid", f"+callbacks.pids.directory={tmp_path}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert out.count("step 4/4 |") == 1  # printed by rank 0 only
    assert "[rank 1]" not in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    pids = {(tmp_path / f"rank{r}.pid").read_text() for r in (0, 1)}
    assert len(pids) == 2 and str(os.getpid()) not in pids
    # both forked from one server process that imported the trainer once (trainer.launch.worker_start_method)
    parents = {(tmp_path / f"rank{r}.parent").read_text() for r in (0, 1)}
    assert len(parents) == 1 and "multiprocessing.forkserver" in parents.pop()
    assert "launching 2 worker(s)" in (tmp_path / "train.log").read_text()
    # the final checkpoint (trainer.save_final), saved by both ranks together, named by the last line
    final = tmp_path / "checkpoints" / "step_00000004"
    assert (final / "checkpoint.json").is_file() and len(list(final.glob("*.distcp"))) == 2
    assert f"final checkpoint: {final}" in out.strip().splitlines()[-1]


@pytest.mark.parametrize(("signal_number", "cause", "detail"), [
    (0, "RuntimeError: injected failure on rank 1 at step 2", "raise RuntimeError(f\"injected failure"),
    (9, "killed by signal 9 (SIGKILL)", "exitcode: -9")], ids=["exception", "sigkill"])
def test_a_failing_rank_ends_the_job_with_one_line_and_its_details_in_the_launchers_log(
        tmp_path: Path, signal_number: int, cause: str, detail: str) -> None:
    # A hang (the other rank waiting forever in a collective) fails through the subprocess timeout.
    result = trainer_cli("strategy=ddp", "trainer.devices=2", "trainer.max_steps=50", f"hydra.run.dir={tmp_path}",
                         "+callbacks.fail._target_=tests.helpers.FailOnRank", "+callbacks.fail.rank=1",
                         "+callbacks.fail.step=2", f"+callbacks.fail.signal={signal_number}", timeout=600)
    assert result.returncode == 1
    out = result.stdout + result.stderr
    # one line for the one cause, naming the rank, what ended it and where the details are
    failed = [line for line in out.splitlines() if "failed" in line]
    assert failed == [f"error: rank 1 failed: {cause} (the launcher's log: {tmp_path / 'launcher.log'})"], out[-3000:]
    # the elastic agent's error-level tracebacks are in that log, not on the console
    assert "Traceback" not in out and "torch/distributed/elastic" not in out, out[-3000:]
    launcher_log = (tmp_path / "launcher.log").read_text()
    assert "Traceback" in launcher_log and detail in launcher_log, launcher_log[-3000:]
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "failed"
    assert not (tmp_path / "summary.json").exists()


def test_torchrun_workers_join_and_share_one_run_dir(tmp_path: Path) -> None:
    """Under torchrun every rank runs the Hydra app; they agree on rank 0's run directory."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "trainer",
         *SMALL, "strategy=zero3", "trainer.devices=2"],
        capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summaries = list((tmp_path / "outputs").rglob("summary.json"))
    assert len(summaries) == 1, summaries
    assert json.loads(summaries[0].read_text())["world_size"] == 2
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert run_dirs == [summaries[0].parent], run_dirs
    assert (result.stdout + result.stderr).count("step 4/4 |") == 1
    # 2 micro-batches a step: grad_sync=auto was settled (and agreed over the group the run joined before
    # building the strategy) once, by rank 0's log
    assert (result.stdout + result.stderr).count("strategy=zero3: grad_sync=auto -> step: whole gradients") == 1


def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    """Two launcher processes (one per 'node') rendezvous on 127.0.0.1 into one 2-process job."""
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "trainer", *SMALL, "strategy=fsdp", "trainer.devices=1", "trainer.num_nodes=2",
               f"trainer.rdzv_endpoint={endpoint}", "trainer.rdzv_id=two-node-test", f"hydra.run.dir={tmp_path}"]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                              env=ENV) for _ in range(2)]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert sum(o.count("step 4/4 |") for o in outputs) == 1


def test_srun_tasks_join_as_one_job(tmp_path: Path) -> None:
    """Two processes with the variables `srun --ntasks 2` sets form one job (no launcher started)."""
    port = str(free_port())
    command = [sys.executable, "-m", "trainer", *SMALL, "strategy=zero1", "trainer.devices=2",
               f"hydra.run.dir={tmp_path}"]
    tasks = []
    for rank in range(2):
        env = {**ENV, "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        tasks.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=REPO, env=env))
    outputs = [task.communicate(timeout=600)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    assert json.loads((tmp_path / "summary.json").read_text())["world_size"] == 2
    assert not any("launching" in o for o in outputs)  # joined, did not launch
