"""Fixtures every test module gets, and the order the session runs its modules in."""

from __future__ import annotations

import os
import shutil
import sys

# Before anything imports torch: the machines this suite runs on set PYTHONDONTWRITEBYTECODE=1, so every
# process it starts (each launch's workers, each CLI run: hundreds) compiled the ~2,000 modules of torch,
# Hydra and the trainer it imports from source again: `import torch, torch.distributed.fsdp, hydra;
# import trainer.run` took 15.0 s of a process start without cached bytecode and 7.0 s with it (measured
# here, 2 cores). The session's processes (this one and those it starts, which inherit its environment)
# write the cache on first import and read it after.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# The session keeps more processes running than the machine has cores (launches beside the tests): OpenMP
# threads that spin while they wait for work burn the CPU the other processes need. Waiting passively
# (read by OpenMP when torch first starts its threads, so before torch is imported; the processes the
# session starts inherit it) changes no result. Measured beside other processes using both cores:
# tests/test_models.py took 14.7 and 14.9 s of user CPU with it, 19.5 and 19.1 s without.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch.compile's C++ builds in this process, not in a pool of compile workers that each import torch first:
# the compiled-blocks test took 64 s alone with the pool (2 workers on this machine) and 46 s without.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Calibrated profiles (trainer/planner/profiles.py: plan.calibrate runs cache theirs, strategy=auto reads them)
# go to a directory of the session's own, never the user's ~/.cache/trainer.
os.environ["TRAINER_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trainer-test-cache-{os.getpid()}")

from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import beside  # noqa: E402

# Tests that must not run beside the shared launches (trainer.hang_timeout_s of a few seconds, straggler
# timings, the launcher's rendezvous): they run last, in this order, after the launches have ended (their
# fixtures wait for them). test_hang's jobs start in the background when the launches end
# (`POOL.add_job(..., after_launches=True)`), so the launcher's tests run while they do, before test_hang
# reads them.
QUIET_MODULES = ("test_launch.py", "test_hang.py")
SLOWEST_RUNS_SHOWN = 25


@pytest.fixture(autouse=True, scope="module")
def _keep_thread_count() -> Iterator[None]:
    """Runs with trainer.num_threads=1 (the machine's cores are shared) change torch's thread count for
    the whole process; each test module hands the count back as it found it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` have deselected
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules that read the shared launches (tests/launch_pool.py) run after the others, which run
    while the launches do; the quiet ones last, in QUIET_MODULES' order."""
    from tests.launch_pool import POOL

    pooled = {f"test_{module}.py" for module in POOL.modules_with_work()}
    routed = {item.nodeid for item in beside.route(items)}

    def rank(item: pytest.Item) -> float:
        name = Path(str(item.fspath)).name
        if name in QUIET_MODULES:
            return 2 + QUIET_MODULES.index(name)
        if item.nodeid in routed:  # they wait for the second process (tests/beside.py): the latest they can
            return 1.5
        return 1 if name in pooled and _multi_process(item) else 0

    items.sort(key=rank)  # stable: each group keeps the collection order


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the shared launches of the selected modules in the background, and the process that runs the
    `beside` tests (not for --collect-only, nor in that process: its tests read no launch)."""
    if session.config.option.collectonly or not session.items or beside.inner():
        return
    from tests.launch_pool import POOL

    selected = {Path(str(item.fspath)).stem.removeprefix("test_") for item in session.items if _multi_process(item)}
    POOL.start(selected & POOL.modules_with_work())
    routed = beside.route_of(session.items)
    if routed:
        beside.start(routed)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    beside.record(report)


def _multi_process(item: pytest.Item) -> bool:
    """Tests that read the shared launches are multi-process, so `slow` (a fast one would still get them,
    from `POOL.ensure`, just not in the background)."""
    return item.get_closest_marker("slow") is not None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How long each shared launch and job took (they run beside the tests: what keeps the suite's time)."""
    from tests.launch_pool import POOL

    if POOL.timings:
        terminalreporter.section("shared launches and jobs: start (s into the session) +seconds (tests/launch_pool.py)")
        for label, start, seconds in sorted(POOL.timings, key=lambda item: item[1]):
            terminalreporter.write_line(f"{start:7.1f} s +{seconds:6.1f} s  {label}")
    if POOL.run_timings:
        slowest = sorted(POOL.run_timings, key=lambda item: -item[1])[:SLOWEST_RUNS_SHOWN]
        terminalreporter.section(f"the {len(slowest)} slowest of the launches' {len(POOL.run_timings)} runs")
        for label, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {label}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The session's shared launches (tests/launch_pool.py) wrote into one temporary directory."""
    from tests.launch_pool import POOL, remove_pool

    POOL.stop()  # a session that ended early (-x, an interrupt) leaves no launch running
    remove_pool()
    shutil.rmtree(os.environ["TRAINER_CACHE_DIR"], ignore_errors=True)
