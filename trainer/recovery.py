"""The fault-to-resume timeline of a job whose workers the elastic agent restarted (`trainer.max_restarts`).

Where each time comes from (all `time.time()`, seconds since the epoch, on the one node here):

- `detected`: the launcher process records the elastic agent's "will restart worker group" log record
  (`FaultRecorder`, into `<run_dir>/faults.jsonl`): when the agent's monitor (every 0.1 s) saw the failed
  worker, just before it stops the others and starts the new ones.
- `last_step_before_fault`: rank 0 of the failed attempt writes its step after every step into
  `<run_dir>/.progress.json` (`record_progress`, only under the agent); the step the job had reached.
- `worker_started`: when the restarted rank 0 entered `worker_main` (after the process start, the
  interpreter's start and torch's import; before the process group, the model and the restore).
- `restore_started` / `restore_s`: around `resume` in the restarted rank 0.
- `first_step_after_fault`: the end of the first optimizer step of the restarted attempt (rank 0).

`steps_lost` is `last_step_before_fault - resumed_step`: steps the job trains again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

FAULTS = "faults.jsonl"
PROGRESS = ".progress.json"
RESTART_MESSAGE = "will restart worker group"
WORKER_STARTED = "TRAINER_WORKER_STARTED"  # set by trainer.launch.worker_main


class FaultRecorder(logging.Handler):
    """A handler on the elastic agent's logger, in the launcher: appends one line per restart decision."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(logging.INFO)
        self.path = Path(run_dir) / FAULTS

    def emit(self, record: logging.LogRecord) -> None:
        if RESTART_MESSAGE not in str(record.msg):
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"detected": record.created, "message": record.getMessage()}) + "\n")


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def under_restarting_agent() -> bool:
    """Whether the elastic agent may restart these workers (then progress is recorded)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0


def record_progress(run_dir: Path, step: int) -> None:
    """Rank 0, after each step under a restarting agent: the step reached and when (an atomic rename of a
    small file, some tens of microseconds)."""
    path = Path(run_dir) / PROGRESS
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps({"step": step, "time": time.time(), "attempt": restart_count()}))
    os.replace(temporary, path)


def worker_started() -> Optional[float]:
    """When this worker entered trainer.launch.worker_main (None outside the launcher)."""
    value = os.environ.get(WORKER_STARTED)
    return float(value) if value else None


def _last_line(path: Path) -> Optional[dict[str, Any]]:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def fault_timeline(run_dir: Path, resumed_step: int, source: str, restore_started: float,
                   restore_s: float) -> dict[str, Any]:
    """The timeline of this restart as far as it is known at the resume (rank 0; see the module's sources)."""
    run_dir = Path(run_dir)
    fault = _last_line(run_dir / FAULTS)
    progress = _last_line(run_dir / PROGRESS)
    if progress is not None and progress.get("attempt") == restart_count():
        progress = None  # written by this attempt already (not possible before its first step): not the fault's
    timeline: dict[str, Any] = {
        "restart": restart_count(),
        "resumed_from": source,
        "resumed_step": resumed_step,
        "detected": fault["detected"] if fault else None,
        "last_step_before_fault": progress["step"] if progress else None,
        "last_step_time": progress["time"] if progress else None,
        "worker_started": worker_started(),
        "restore_started": restore_started,
        "restore_s": restore_s,
        "steps_lost": progress["step"] - resumed_step if progress else None,
    }
    return timeline


def complete(timeline: dict[str, Any], first_step_end: float, step: int) -> dict[str, Any]:
    """Add the first step after the fault and the intervals between the recorded times."""
    timeline = dict(timeline, first_step_after_fault=step, first_step_end=first_step_end)
    detected = timeline.get("detected")
    if detected is not None:
        started = timeline.get("worker_started")
        timeline["detection_to_worker_start_s"] = started - detected if started is not None else None
        timeline["detection_to_first_step_s"] = first_step_end - detected
    if timeline.get("last_step_time") is not None:
        # from the last step the job completed before the fault (the fault itself comes after it)
        timeline["last_step_to_first_step_s"] = first_step_end - timeline["last_step_time"]
    return timeline


def describe(timeline: dict[str, Any]) -> str:
    """One line for the run log."""
    def seconds(key: str) -> str:
        value = timeline.get(key)
        return f"{value:.2f} s" if isinstance(value, (int, float)) else "unknown"

    return (f"recovery (restart {timeline['restart']}): resumed at step {timeline['resumed_step']} from "
            f"{timeline['resumed_from']}; fault detected -> worker started {seconds('detection_to_worker_start_s')}, "
            f"restore {seconds('restore_s')}, detected -> first step ({timeline.get('first_step_after_fault')}) "
            f"{seconds('detection_to_first_step_s')}; steps lost {timeline.get('steps_lost', 'unknown')}")
