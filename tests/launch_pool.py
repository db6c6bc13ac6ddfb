"""One launch per world size for the multi-process runs of the whole session.

Starting N processes costs seconds each on a 2-core machine (torch's import, the rendezvous), so the test
modules do not launch their own: each registers its runs with `POOL.add` when it is imported (at
collection), and its module fixture calls `POOL.ensure(world)`, which launches every run registered for
that world size by every collected module in one launch of tests/distributed_harness.py, the
first time any module asks. A run writes into `<module directory>/np<world>/<name>` as the modules'
own launches did. Runs that read what a launch of another world size wrote (a checkpoint resumed under
another layout) are registered with `stage=1`: every stage-0 launch runs before any stage-1 launch.

A launch that fails (a run raised, a rank died) is not the end of the others' runs: the run that was in
progress is recorded as failed with the launch's output, and the runs after it are launched again. A
module whose runs failed gets the recorded output from `ensure`.

The launches keep both cores busy, the single-process tests about one (process starts, Python), so once
the session's tests are collected (tests/conftest.py) `start` launches, in a thread, everything the selected
modules registered while the other modules' tests run; the modules that read the launches run last, and
`ensure` waits for the launches it needs. The launch of one process runs in a thread of its own beside the
others: a multi-process launch leaves part of the machine idle while its ranks wait for each other (the
8-process launch used 390 s of CPU in 274 s, 1.4 of the 2 cores, in a session measured on 2026-11-29). A
test that must have the machine to itself (timeouts of a few seconds) waits for every launch with
`wait_all`.

Work a module would otherwise do in this process before reading (the README's sequence of commands) is a
job: a command registered with `add_job`, started with the launches by `start`, read with `job`. Runs that
need one process only are launches of one process (world size 1), for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
HARNESS_LAUNCHER = REPO / "tests" / "harness_launcher.py"  # starts the workers of tests/distributed_harness.py
LAUNCH_TIMEOUT_S = 3600


@dataclass
class Batch:
    """The runs one module registered for one world size and stage."""

    module: str
    world: int
    stage: int
    runs: list[dict[str, Any]]
    prepare: Optional[Callable[[], None]] = None  # writes what the runs read (data files), before the launch
    failures: dict[str, str] = field(default_factory=dict)  # run name -> the launch's output
    launched: bool = False


@dataclass
class Job:
    """A module's sequence of foreground work run as a process of its own, beside the tests (`add_job`)."""

    module: str
    command: list[str]
    after_launches: bool = False  # started once the launches have ended (`add_job`)
    env: dict[str, str] = field(default_factory=dict)  # added to the session's environment
    before: Optional[Callable[[], None]] = None  # runs in the session's process just before the start
    process: Optional[subprocess.Popen[str]] = None
    result: Optional[tuple[int, str]] = None  # exit code, output
    started: float = 0.0  # time.perf_counter() at its start


class LaunchPool:
    """The session's multi-process runs, launched once per (stage, world size)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.batches: list[Batch] = []
        self.launched: set[tuple[int, int]] = set()  # (stage, world)
        self.modules: set[str] | None = None  # the modules whose runs launch (None: all registered)
        self._locks: dict[tuple[int, int], threading.Lock] = {}  # (stage, world) -> held while it launches
        self._guard = threading.Lock()  # the pool's shared state: the locks, the first launch's clean-up
        self._cleaned = False  # the first launch emptied the directory
        self._errors: dict[tuple[int, int], BaseException] = {}  # a launch's machinery failed (a prepare)
        self._backgrounds: list[threading.Thread] = []
        self._processes: set[subprocess.Popen[str]] = set()  # the launches running now
        self._stopped = False
        self.jobs: dict[str, Job] = {}
        # (what ran, its start in seconds after this pool was made, its seconds) per launch and job: the
        # session's summary prints them (what overlapped what)
        self.timings: list[tuple[str, float, float]] = []
        self.created = time.perf_counter()
        self.run_timings: list[tuple[str, float]] = []  # the same per run of a launch (the harness's seconds.txt)

    def directory(self, module: str) -> Path:
        """Where a module's runs write: `<root>/<module>/np<world>/<name>`."""
        return self.root / module

    def add(self, module: str, world: int, runs: list[dict[str, Any]], *, stage: int = 0,
            prepare: Optional[Callable[[], None]] = None, count_collectives: bool = False) -> Path:
        """Register `runs` (each `{"name", "overrides"}`) for a launch of `world` processes; with
        `count_collectives` each summary gets rank 0's collectives (tests/distributed_harness.py).
        Returns the module's directory."""
        _check_module_name(module)
        if (stage, world) in self.launched:
            raise RuntimeError(f"{module}: runs added to a launch of {world} processes (stage {stage}) that "
                               "already ran; register them when the module is imported")
        out = self.directory(module) / f"np{world}"
        names = [run["name"] for run in runs]
        if len(set(names)) != len(names):
            raise ValueError(f"{module}: run names repeat: {names}")
        self.batches.append(Batch(module, world, stage, [
            {**run, "dir": str(out / run["name"]), "count_collectives": count_collectives} for run in runs],
            prepare))
        return self.directory(module)

    def modules_with_work(self) -> set[str]:
        """The modules that registered runs or a job."""
        return {batch.module for batch in self.batches} | set(self.jobs)

    @property
    def jobs_root(self) -> Path:
        """Where jobs write (beside the launches' directory, which the first launch empties)."""
        return self.root.with_name(self.root.name + "-jobs")

    def add_job(self, module: str, command: list[str], *, after_launches: bool = False) -> None:
        """Register a command (run in the repository) whose results `module` reads with `job`: started with
        the launches, it runs beside the tests instead of inside the test that needs it. With
        `after_launches` it starts when the launches have ended (work that must not share the machine with
        them: timeouts of seconds), still beside the tests that remain."""
        _check_module_name(module)
        self.jobs[module] = Job(module, command, after_launches)

    def add_session_job(self, name: str, command: list[str], *, env: dict[str, str],
                        before: Optional[Callable[[], None]] = None) -> None:
        """Register and start now a job that belongs to the session rather than to one module (tests/beside.py:
        the second pytest process); read with `job(name)`."""
        self.jobs[name] = Job(name, command, env=env, before=before)
        self._start_job(self.jobs[name])

    def job(self, module: str) -> tuple[int, str]:
        """Wait for `module`'s job (started now if it was not): its exit code and output."""
        job = self.jobs[module]
        if job.result is None:
            if job.after_launches:
                self.wait_all()
            self._start_job(job)
            assert job.process is not None
            try:
                job.process.wait(timeout=LAUNCH_TIMEOUT_S)
                note = ""
            except subprocess.TimeoutExpired:
                kill_tree(job.process.pid)
                job.process.wait()
                note = f"\ntimed out after {LAUNCH_TIMEOUT_S} s"
            job.result = (job.process.returncode, self._job_log(job).read_text()[-6000:] + note)
        return job.result

    def _job_log(self, job: Job) -> Path:
        return self.jobs_root / f"{job.module}.log"

    def _start_job(self, job: Job) -> None:
        with self._guard:  # the test that reads it and the thread of `after_launches` may both start it
            if job.process is not None:
                return
            # into a file, not a pipe: nobody reads the job's output until a test needs its results
            self.jobs_root.mkdir(parents=True, exist_ok=True)
            if job.before is not None:
                job.before()
            job.started = time.perf_counter()
            with open(self._job_log(job), "w") as log:
                job.process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, text=True,
                                               cwd=REPO, env={**os.environ, **job.env}, start_new_session=True)
        threading.Thread(target=self._time_job, args=(job,), name=f"job-{job.module}", daemon=True).start()

    def _time_job(self, job: Job) -> None:
        assert job.process is not None
        job.process.wait()
        self.timings.append((f"job {job.module}", job.started - self.created, time.perf_counter() - job.started))

    def start(self, modules: set[str]) -> None:
        """Start the jobs of `modules` (those registered `after_launches` once the launches have ended), and
        launch, in a background thread and in `ensure`'s order, every run `modules` registered."""
        jobs = [self.jobs[module] for module in sorted(modules & set(self.jobs))]
        for job in jobs:
            if not job.after_launches:
                self._start_job(job)
        later = [job for job in jobs if job.after_launches]
        self.modules = modules
        order = [key for key in self._order() if self._batches(*key)]
        beside = [key for key in order if key == (0, 1)]  # the launch of one process (module docstring)
        for name, keys in (("launch-pool", [key for key in order if key not in beside]),
                           ("launch-pool-single", beside)):
            if keys:
                thread = threading.Thread(target=self._launch_all, args=(keys,), name=name, daemon=True)
                self._backgrounds.append(thread)
                thread.start()
        if later:
            threading.Thread(target=self._start_after_launches, args=(later,), name="jobs-after-launches",
                             daemon=True).start()

    def _start_after_launches(self, jobs: list[Job]) -> None:
        self.wait_all()
        for job in jobs:
            if not self._stopped:
                self._start_job(job)

    def wait_all(self) -> None:
        """Wait for the background launches (a test that needs the machine to itself)."""
        for thread in self._backgrounds:
            thread.join()

    def stop(self) -> None:
        """End the running launch and launch nothing more (the session is over)."""
        self._stopped = True
        for process in [*self._processes] + [job.process for job in self.jobs.values()]:
            if process is not None and process.poll() is None:
                kill_tree(process.pid)
        self.wait_all()

    def _order(self) -> list[tuple[int, int]]:
        return sorted({(b.stage, b.world) for b in self.batches})

    def _batches(self, stage: int, world: int, module: str | None = None) -> list[Batch]:
        """The batches of a launch still to run: of the selected modules, and `module`'s."""
        return [b for b in self.batches if (b.stage, b.world) == (stage, world) and not b.launched
                and (self.modules is None or b.module in self.modules or b.module == module)]

    def _launch_all(self, order: list[tuple[int, int]]) -> None:
        for stage, world in order:
            try:
                self._launch(world, stage)
            except BaseException as error:  # noqa: BLE001 - handed to the tests that need this launch
                self._errors[(stage, world)] = error

    def ensure(self, world: int, module: str, stage: int = 0) -> Path:
        """Launch (once) everything registered for `world` processes at `stage`, after every earlier stage,
        and fail if one of `module`'s runs there failed. Returns `module`'s directory."""
        failed = self.wait(world, module, stage)
        if failed:
            name, output = next(iter(failed.items()))
            raise AssertionError(f"{module}: run(s) {sorted(failed)} of the {world}-process launch failed; "
                                 f"the launch's output while '{name}' ran:\n{output}")
        return self.directory(module)

    def wait(self, world: int, module: str, stage: int = 0) -> dict[str, str]:
        """`ensure` without failing: the launch's output for each of `module`'s runs there that failed."""
        self._launch(world, stage, module)
        if (stage, world) in self._errors:
            raise self._errors[(stage, world)]
        return {name: output for batch in self.batches
                if (batch.module, batch.world, batch.stage) == (module, world, stage)
                for name, output in batch.failures.items()}

    def _launch(self, world: int, stage: int, module: str | None = None) -> None:
        """Run (once) what is registered for (stage, world), after every launch of an earlier stage (in this
        thread, or waiting for the thread that runs it)."""
        for earlier, other in self._order():
            if earlier < stage:
                self._launch(other, earlier)
        with self._guard:
            lock = self._locks.setdefault((stage, world), threading.Lock())
        with lock:
            batches = self._batches(stage, world, module)
            if not batches:
                return
            with self._guard:
                if not self._cleaned:  # the session's first launch: a directory of an earlier process's pid goes
                    shutil.rmtree(self.root, ignore_errors=True)
                    self._cleaned = True
                self.launched.add((stage, world))
            for batch in batches:
                batch.launched = True
            self._run_batches(world, stage, batches)

    def _run_batches(self, world: int, stage: int, batches: list[Batch]) -> None:
        for batch in batches:
            if batch.prepare is not None:
                batch.prepare()
        pending = [(batch, run) for batch in batches for run in batch.runs]
        started = time.perf_counter()
        label = (f"launch of {world} process(es), stage {stage}: {len(pending)} runs of "
                 + ", ".join(sorted({batch.module for batch in batches})))
        try:
            self._run_pending(world, stage, pending)
        finally:
            self.timings.append((label, started - self.created, time.perf_counter() - started))
            for batch, run in pending:
                seconds = Path(run["dir"]) / "seconds.txt"
                if seconds.exists():
                    self.run_timings.append((f"np{world} {batch.module}/{run['name']}", float(seconds.read_text())))

    def _run_pending(self, world: int, stage: int, pending: list[tuple[Batch, dict[str, Any]]]) -> None:
        attempt = 0
        while pending and not self._stopped:
            output, done = self._launch_once(world, stage, attempt, [run for _, run in pending])
            if done == len(pending):
                return
            # the run in progress failed (or took its launch down): record it, go on after it
            batch, run = pending[done]
            batch.failures[run["name"]] = output
            pending = pending[done + 1:]
            attempt += 1

    def _launch_once(self, world: int, stage: int, attempt: int, runs: list[dict[str, Any]]) -> tuple[str, int]:
        """One launch of `runs`; the launch's output tail and how many runs completed."""
        spec = self.root / f"spec_np{world}_stage{stage}_{attempt}.json"
        spec.parent.mkdir(parents=True, exist_ok=True)
        spec.write_text(json.dumps({"out": str(self.root / f"logs_np{world}_stage{stage}_{attempt}"),
                                    "runs": runs}))
        # its own session: `stop` ends the launcher and its workers together
        process = subprocess.Popen(
            harness_command(world, spec),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        self._processes.add(process)
        try:
            stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_S)
            output = stdout[-3000:] + stderr[-6000:]
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            stdout, stderr = process.communicate()
            output = f"timed out after {LAUNCH_TIMEOUT_S} s\n{stderr}"[-6000:]
        finally:
            self._processes.discard(process)
        done = 0
        while done < len(runs) and (Path(runs[done]["dir"]) / "summary.json").exists():
            done += 1
        return output, done


def _check_module_name(module: str) -> None:
    """A module registers under the name of its file without `test_`: the session starts the work of the
    selected modules by that name (tests/conftest.py), so work under another name waits until a test asks
    for it (seen: a job named after its file ran on the session's critical path for 110 s)."""
    if not (REPO / "tests" / f"test_{module}.py").is_file():
        raise ValueError(f"{module!r} names no test module: register as the file tests/test_NAME.py's NAME")


def kill_tree(pid: int) -> None:
    """SIGKILL a process started in its own session, its process group and every descendant.

    The process group alone is not enough: a worker may run in a session of its own (torchrun's do), so it
    outlives a killed launcher, holds its output pipes open (`communicate` waits for them) and
    waits on its peers for good (seen: a session ended by `-x` waited 10 minutes for such a worker)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces, the fields after its ")" do not
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process has just ended
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, index = [pid], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for member in tree[1:]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def harness_command(nproc: int, spec: Path) -> list[str]:
    """A launch of `nproc` harness workers running the runs of `spec` (tests/distributed_harness.py)."""
    return [sys.executable, str(HARNESS_LAUNCHER), str(nproc), str(spec)]


def launch_harness(out: Path, nproc: int, runs: list[dict], count_collectives: bool = False) -> None:
    """All `runs` in a launch of their own of `nproc` processes, writing `<out>/np<nproc>/<name>`: for runs
    that must start from what the test process made just before (the pool launches before any test)."""
    spec = out / f"spec_{nproc}.json"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"out": str(out / f"np{nproc}"), "runs": runs, "count_collectives": count_collectives}))
    result = subprocess.run(
        harness_command(nproc, spec),
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


# Named, not made, at import: the launched workers import test modules too (their callbacks), and must not
# leave directories behind. The first launch makes it; tests/conftest.py removes it when the session ends.
POOL = LaunchPool(Path(tempfile.gettempdir()) / f"trainer-launches-{os.getpid()}")


def remove_pool() -> None:
    """At the session's end; `TRAINER_TEST_KEEP_LAUNCHES=1` keeps the directory (to read the runs' logs)."""
    if os.environ.get("TRAINER_TEST_KEEP_LAUNCHES") != "1":
        shutil.rmtree(POOL.root, ignore_errors=True)
        shutil.rmtree(POOL.jobs_root, ignore_errors=True)
