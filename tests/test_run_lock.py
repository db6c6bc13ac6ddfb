"""One run per run directory (trainer/run_lock.py): a second run is refused with one line naming the holder,
before it writes anything there; a lock whose process is gone is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config import ConfigError
from trainer.run_lock import LOCK_FILE, acquire, release, run_directory_lock

REPO = Path(__file__).resolve().parent.parent


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def write_lock(run_dir: Path, pid: int, host: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid,
                                                 "started": time.time() - 60}))


def test_a_held_directory_is_refused_and_released_after_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with run_directory_lock(run_dir):
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
        with pytest.raises(ConfigError, match=rf"^hydra.run.dir: {run_dir} is in use by another run \(pid "
                                              rf"{os.getpid()} on {socket.gethostname()}, since "):
            acquire(run_dir)
    assert not (run_dir / LOCK_FILE).exists()
    with run_directory_lock(run_dir):  # free again
        pass


def test_a_lock_whose_process_is_gone_is_taken_over_and_said_so(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "run"
    pid = dead_pid()
    write_lock(run_dir, pid)
    with caplog.at_level("WARNING", logger="trainer"):
        me = acquire(run_dir)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"its run (pid {pid}) is gone" in caplog.text
    release(run_dir, me)


def test_a_lock_from_another_host_is_not_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_lock(run_dir, dead_pid(), host="node17")
    with pytest.raises(ConfigError, match=rf"on node17, .*a lock from another host: remove {run_dir / LOCK_FILE}"):
        acquire(run_dir)


def test_release_leaves_a_lock_another_run_took(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    me = acquire(run_dir)
    write_lock(run_dir, 1)  # pid 1 is alive: another run's lock now
    release(run_dir, me)
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == 1


TINY = ["trainer.max_steps=1", "trainer.seq_len=32", "trainer.val_every=0", "trainer.val_batches=1",
        "data.max_bytes=100000", "lr_schedule.warmup_steps=0", "callbacks=none", "trainer.peak_flops=1e12"]


@pytest.mark.slow
@pytest.mark.beside
def test_a_second_run_in_the_same_directory_is_one_line_and_writes_nothing_there(tmp_path: Path) -> None:
    """The directory of a live run (this test process holds its lock): the second run exits 2 with one line
    before Hydra or the trainer writes anything into it. Then, the holder gone, a run takes the lock over,
    trains and leaves the directory unlocked."""
    run_dir = tmp_path / "run"
    write_lock(run_dir, os.getpid())
    command = [sys.executable, "-m", "trainer", f"hydra.run.dir={run_dir}", *TINY]
    refused = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"error: hydra.run.dir: {run_dir} is in use by another run (pid {os.getpid()} on {socket.gethostname()}, "
        f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(json.loads((run_dir / LOCK_FILE).read_text())['started']))}): "
        "wait for it to end or pick another hydra.run.dir"]
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]

    write_lock(run_dir, dead_pid())
    taken = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert "is gone" in taken.stdout + taken.stderr
    assert (run_dir / "summary.json").exists() and not (run_dir / LOCK_FILE).exists()
