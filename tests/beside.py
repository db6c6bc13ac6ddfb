"""Tests that run beside the session: in a second pytest process started at collection.

The session's own process runs its tests one after another, and the tests that start real `python -m
trainer` processes and wait for them (kills and resumes, Ctrl-C, calibration, sweeps, torch.compile's C++
builds) kept it busy for most of the suite while the launches beside it had ended (measured on 2026-12-01:
the session's process ended 270 s after the last launch and 160 s after the last job). A test
marked `@pytest.mark.beside` is run by a second pytest process that the session starts with its launches
(tests/launch_pool.py, `start`); in the session's own process the test waits for that process and reports
the outcome it recorded there: passed, failed with the second process's failure text, or skipped with its
reason. The second process runs the selected `beside` tests in collection order, each exactly as a session
would run it (fixtures, tmp_path), so a `beside` test is written like any other.

A session whose selected tests are all `beside` (`pytest tests/test_crash.py`) runs them in its own process:
nothing would run beside them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

# Set in the second process: the file it appends each test's outcome to (and the mark that it is that process).
RESULTS_ENV = "TRAINER_TEST_BESIDE_RESULTS"
MARKER = "beside"
JOB = "beside-tests"
ROUTED = pytest.StashKey[bool]()


def inner() -> bool:
    """Whether this process is the second one, which runs the `beside` tests itself."""
    return RESULTS_ENV in os.environ


def route(items: list[pytest.Item]) -> list[pytest.Item]:
    """In the session's process: the selected `beside` tests, each set to report the second process's
    outcome (none when this is the second process, or when nothing else is selected)."""
    if inner():
        return []
    beside = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if len(beside) == len(items):
        return []
    for item in beside:
        item.runtest = _reporter(item.nodeid)  # type: ignore[method-assign]
        item.stash[ROUTED] = True
    return beside


def route_of(items: list[pytest.Item]) -> list[pytest.Item]:
    """The tests `route` set to report the second process's outcome."""
    return [item for item in items if item.stash.get(ROUTED, False)]


def start(items: list[pytest.Item]) -> None:
    """Start the second process on `items` (the routed tests), in the pool as a job of its own."""
    from tests.launch_pool import POOL

    results = POOL.jobs_root / f"{JOB}.jsonl"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(item.nodeid for item in items)]
    POOL.add_session_job(JOB, command, env={RESULTS_ENV: str(results)}, before=lambda: results.unlink(missing_ok=True))


def record(report: pytest.TestReport) -> None:
    """In the second process: append one phase's outcome of a test (pytest_runtest_logreport)."""
    if not inner():
        return
    entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": report.longreprtext}
    if report.skipped and isinstance(report.longrepr, tuple):
        entry["text"] = str(report.longrepr[2])  # (file, line, reason)
    with open(os.environ[RESULTS_ENV], "a") as f:
        f.write(json.dumps(entry) + "\n")


def _reporter(nodeid: str) -> Any:
    def runtest() -> None:
        from tests.launch_pool import POOL

        code, output = POOL.job(JOB)
        results = POOL.jobs_root / f"{JOB}.jsonl"
        phases = [entry for entry in _entries(results) if entry["nodeid"] == nodeid]
        if not any(entry["when"] == "call" or entry["outcome"] != "passed" for entry in phases):
            pytest.fail(f"the beside process (exit {code}) recorded no outcome for {nodeid}:\n{output}", pytrace=False)
        failed = [entry for entry in phases if entry["outcome"] == "failed"]
        if failed:
            pytest.fail("\n\n".join(f"[beside process, {entry['when']}]\n{entry['text']}" for entry in failed),
                        pytrace=False)
        skipped = [entry for entry in phases if entry["outcome"] == "skipped"]
        if skipped:
            pytest.skip(skipped[0]["text"])

    return runtest


def _entries(results: Path) -> list[dict[str, Any]]:
    if not results.exists():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
