"""The hang watchdog and the straggler report (issue 16), one callback the run adds on every rank.

Watchdog. A daemon thread per rank checks a deadline that the loop pushes forward whenever a training
step, a validation or a checkpoint save completes: `trainer.hang_timeout_s`, times
`hang_first_step_factor` until the first step of this process completes (start-up, compilation, a
resumed load) and times `hang_save_factor` while a checkpoint is written. When the deadline passes, each
rank writes `<run dir>/hang/rank_R.txt` (every thread's Python stack, its last collectives: see
trainer/collectives.py) and `rank_R.json` (the same facts for the diagnosis). Rank 0 waits for the other
reports (at most `REPORT_GRACE_S`), writes the diagnosis paragraph (trainer/diagnosis.py) to
`hang/diagnosis.txt`, to train.log and into the elastic error file, and the process exits with status 1:
the agent stops the others, and `trainer.max_restarts` restarts the job from its last checkpoint. The
other ranks exit too if rank 0 has not ended the job after a while (a rank 0 that cannot run its thread).
A rank that cannot write its report (SIGSTOPped, stuck holding the GIL) would not honour the agent's
SIGTERM either, and the agent waits 30 s before its SIGKILL: every rank tells the others its host and pid
at the start (one all-gather), so rank 0 stops waiting for a report from a rank on its host whose
process is stopped or gone, names its state in the diagnosis and has it SIGKILLed 1 s after its own exit
(so that the agent reports the diagnosing rank's failure, not the killed one's); a rank whose rank 0 is
stopped does the same to rank 0. Ranks on other hosts are left to their own agent.
The thread needs the GIL: gloo and NCCL waits, `time.sleep` and Python code release it; a rank stuck
in C code that holds it writes nothing, and the diagnosis says that its report is missing.

The process group's own timeout (gloo, NCCL) is set above the watchdog's longest deadline by the run
(`collective_timeout_s`), so the diagnosis comes first.

Stragglers. Each rank keeps the start and end of its steps; at a log step all ranks exchange them with
the issue times of their collectives in those steps (flight recorder, matched by process group and
sequence number). Reading the recorder costs tens of milliseconds, so a report runs once the steps since
the previous one have taken its cost divided by `straggler_overhead` (the same step on every rank: the
interval is computed from the gathered figures), and at the last step; steps whose collectives the ring no
longer holds are left out. A rank's waiting time in a step is the largest gap between its arrival at one of the
step's collectives and the last member's arrival (gaps of overlapping asynchronous collectives do not
add up, so the largest is taken), its compute time the rest of the step. A rank whose compute time is
above the median of the other ranks' by more than `straggler_margin` (and 5 ms) for `straggler_steps` consecutive steps is
named in a warning line and in the metrics (`straggler_rank`, `straggler_slowdown`), with the per-rank
`compute_s/rank_R` and `wait_s/rank_R` (world sizes up to 16) and their medians.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.callback import Callback
from trainer.collectives import (P2PRecorder, flight_recorder_capacity, flight_recorder_entries, group_names,
                                 normalize_fr_entry)
from trainer.diagnosis import diagnose, format_ranks

log = logging.getLogger("trainer")
REPORT_GRACE_S = 30.0  # rank 0 waits this long for the other ranks' reports
OTHERS_EXIT_AFTER_S = 90.0  # a rank other than 0 ends itself this long after its report
OTHERS_EXIT_DELAY_S = 3.0  # after rank 0's diagnosis
POLL_S = 0.5
KILL_DELAY_S = 1.0  # a frozen rank is killed this long after the diagnosing rank's exit (see `_kill`)
HANG_EXIT_CODE = 1
PER_RANK_METRICS_MAX_WORLD = 16
STRAGGLER_FLOOR_S = 0.005
RECORDER_FILE = os.path.join("trainer", "collectives.py")  # its wrapper is not where the caller waits
TORCH_DIR = str(Path(dist.__file__).resolve().parents[1])
STDLIB_DIR = str(Path(threading.__file__).resolve().parent)


def _frame_location(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch and the standard library (where our code is), and the innermost
    one when that is elsewhere (the torch call it waits in)."""
    if not frames:
        return "an unknown place"
    def short(frame: traceback.FrameSummary) -> str:
        path = frame.filename
        for root in (os.getcwd(), TORCH_DIR, STDLIB_DIR):
            if path.startswith(root + os.sep):
                path = os.path.relpath(path, root)
                break
        return f"{path}:{frame.lineno} ({frame.name})"
    own = [f for f in frames if not f.filename.startswith((TORCH_DIR, STDLIB_DIR)) and "<" not in f.filename[:1]
           and not f.filename.endswith(RECORDER_FILE)]
    inner = frames[-1]
    if own and own[-1] is not inner:
        return f"{short(own[-1])}, inside torch's {short(inner)}"
    return short(inner)


class HangWatchdog(Callback):
    """See the module docstring. Made by trainer.run for every run with `trainer.hang_timeout_s > 0` (the
    straggler report also runs with the watchdog off when `trainer.straggler_margin > 0`)."""

    def __init__(self, *, timeout_s: float, first_step_factor: float = 5.0, save_factor: float = 3.0,
                 straggler_margin: float = 0.5, straggler_steps: int = 5, straggler_overhead: float = 0.01,
                 record_pipeline: bool = True) -> None:
        self.timeout_s = float(timeout_s)
        self.first_step_factor = float(first_step_factor)
        self.save_factor = float(save_factor)
        self.straggler_margin = float(straggler_margin)
        self.straggler_steps = int(straggler_steps)
        self.straggler_overhead = float(straggler_overhead)
        self._next_report = 0  # the first step at which the next straggler report may run
        self.p2p = P2PRecorder.install() if record_pipeline else None
        self.deadline = float("inf")
        self.phase = "start-up"
        self.allowed_s = self.timeout_s
        self.microbatch = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._trainer: Any = None
        self._steps: list[tuple[int, int, int]] = []  # (step, start ns, end ns) since the last report
        self._slow_streak: dict[int, int] = {}
        self._hooks: list[Any] = []
        self._processes: list[tuple[str, int]] = []  # (host, pid) of every rank
        self.straggler_warnings: list[str] = []

    # ---- deadline ---------------------------------------------------------------------------------------
    def _arm(self, phase: str, factor: float = 1.0) -> None:
        self.phase = phase
        self.allowed_s = self.timeout_s * factor
        self.deadline = time.monotonic() + self.allowed_s

    def on_fit_start(self, trainer: Any) -> None:
        self._trainer = trainer
        names = group_names(trainer.strategy.parallel_dims)
        if self.p2p is not None:
            self.p2p.names = names
        self._names = names
        self._groups = {}
        if dist.is_initialized():
            for group, pg_name in dist.distributed_c10d._world.pg_names.items():
                if pg_name in names:
                    self._groups[pg_name] = {"name": names[pg_name], "ranks": dist.get_process_group_ranks(group)}
        for part in trainer.model_parts:
            self._hooks.append(part.register_forward_pre_hook(self._count_microbatch))
        if self.timeout_s > 0:
            hang_dir = trainer.run_dir / "hang"
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if trainer.is_global_zero and restart > 0 and hang_dir.is_dir():
                hang_dir.rename(trainer.run_dir / f"hang.attempt{restart - 1}")  # keep the last attempt's reports
            self._start(f"the first step (step {trainer.step + 1})", self.first_step_factor)
            if trainer.strategy.world_size > 1:  # watched: a rank that never arrives is diagnosed
                self._processes = [tuple(p) for p in trainer.strategy.all_gather_object(
                    (socket.gethostname(), os.getpid()))]

    def _start(self, phase: str, factor: float) -> None:
        self._arm(phase, factor)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def _count_microbatch(self, module: Any, args: Any) -> None:
        self.microbatch += 1

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        self.microbatch = 0
        if self.p2p is not None:
            self.p2p.new_step(trainer.step + 1)
        if self.phase.startswith("step") or self.phase.startswith("validation"):
            self.phase = f"step {trainer.step + 1}"
        self._step_start = time.time_ns()

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        self._steps.append((trainer.step, self._step_start, time.time_ns()))
        self.microbatch = 0
        log_step = trainer.step % trainer.config.log_every == 0 and trainer.step >= self._next_report
        if self.straggler_margin > 0 and (log_step or trainer.step == trainer.total_steps):
            self._report_stragglers(trainer)
        self._arm(f"step {trainer.step + 1}")

    def on_validation_end(self, trainer: Any) -> None:
        self._arm(f"step {trainer.step + 1}")

    def on_save_checkpoint(self, trainer: Any, checkpoint: dict[str, Any]) -> None:
        self._arm(f"the checkpoint save of step {trainer.step}", self.save_factor)

    def on_fit_end(self, trainer: Any) -> None:
        self.stop()  # `watch_final_save` watches what trainer.run.train does after fit

    def on_exception(self, trainer: Any, exception: BaseException) -> None:
        self.stop()

    def watch_final_save(self, trainer: Any) -> None:
        """Watch the final checkpoint save and summary of trainer.run.train (then `stop`)."""
        if self.timeout_s > 0:
            self._trainer = trainer
            self._start("the final checkpoint save", self.save_factor)

    def stop(self) -> None:
        """End the thread and drop the trainer (whose model holds the process group: see trainer.run.train)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S + 1)
        self._thread = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._trainer = None

    # ---- the thread -------------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if time.monotonic() > self.deadline and self._trainer is not None:
                try:
                    self._fire()
                finally:
                    os._exit(HANG_EXIT_CODE)

    def report(self) -> dict[str, Any]:
        """This rank's facts: where each thread is, its last collectives and pipeline operations."""
        trainer = self._trainer
        frames = sys._current_frames()
        threads = {t.ident: t.name for t in threading.enumerate()}
        stacks = {threads.get(ident, str(ident)): traceback.extract_stack(frame) for ident, frame in frames.items()
                  if ident != threading.get_ident()}
        main = stacks.get("MainThread", [])
        dims = trainer.strategy.parallel_dims
        pp_stage = 0
        if dims is not None and dims.pp > 1:
            pp_stage = dims.mesh["pp"].get_local_rank()
        return {
            "rank": trainer.strategy.rank,
            "step": trainer.step + 1,
            "phase": self.phase,
            "allowed_s": self.allowed_s,
            "microbatch": self.microbatch,
            "pp_stage": pp_stage,
            "location": _frame_location(main),
            "stacks": {name: traceback.format_list(stack) for name, stack in stacks.items()},
            "collectives": [normalize_fr_entry(e, self._names) for e in flight_recorder_entries()[-200:]],
            "p2p": self.p2p.snapshot() if self.p2p is not None else [],
            "groups": self._groups,
            "time_ns": time.time_ns(),
        }

    def _fire(self) -> None:
        trainer = self._trainer
        rank, world = trainer.strategy.rank, trainer.strategy.world_size
        hang_dir = trainer.run_dir / "hang"
        hang_dir.mkdir(parents=True, exist_ok=True)
        report = self.report()
        write_report(hang_dir, report)
        if rank != 0:
            log.error(f"hang: rank {rank} made no progress for {self.allowed_s:g} s during {self.phase}; "
                      f"report in {hang_dir / f'rank_{rank}.txt'}")
            # Rank 0 writes the diagnosis and ends the job; this rank then ends too, with the same message
            # (whichever exit the launcher sees first, it reports the diagnosis). If rank 0 cannot, this
            # rank ends the job after a while.
            diagnosis = hang_dir / "diagnosis.txt"
            waited = time.monotonic() + OTHERS_EXIT_AFTER_S
            rank_0_state = "running"
            while time.monotonic() < waited and not diagnosis.exists():
                rank_0_state = self._local_state(0)
                if rank_0_state in ("stopped", "gone"):
                    break
                time.sleep(POLL_S)
            try:
                message = diagnosis.read_text().strip()
            except OSError:
                message = (f"hang on rank {rank} during {self.phase}, and rank 0 wrote no diagnosis: see the "
                           f"reports in {hang_dir}")
                if rank_0_state == "stopped":
                    message += f"; rank 0 wrote no report: {self._describe(0, rank_0_state)}"
                    log.error(message)
                    _write_error_file(message)
                    self._kill([0])
                    return  # this rank's exit, with the message, is the one the launcher reports
                log.error(message)
            _write_error_file(message)
            time.sleep(OTHERS_EXIT_DELAY_S)  # rank 0's exit is the one the launcher reports
            return
        waited = time.monotonic() + REPORT_GRACE_S
        while time.monotonic() < waited:
            written = {int(path.stem.split("_")[1]) for path in hang_dir.glob("rank_*.json")}
            silent = [r for r in range(world) if r not in written]
            # a stopped or vanished process on this host will not write: no need to wait for it
            if all(self._local_state(r) in ("stopped", "gone") for r in silent):
                break
            time.sleep(POLL_S)
        reports = {}
        for path in hang_dir.glob("rank_*.json"):
            try:
                data = json.loads(path.read_text())
                reports[int(data["rank"])] = data
            except (OSError, ValueError, KeyError):
                continue
        missing = [r for r in range(world) if r not in reports]
        states = {r: self._local_state(r) for r in missing}
        absent = {r: self._describe(r, state) for r, state in states.items()}
        paragraph = diagnose(reports, world, self.allowed_s, str(hang_dir), absent)
        (hang_dir / "diagnosis.tmp").write_text(paragraph + "\n")
        (hang_dir / "diagnosis.tmp").rename(hang_dir / "diagnosis.txt")
        log.error(paragraph)
        for handler in logging.getLogger().handlers:
            handler.flush()
        _write_error_file(paragraph)
        # they would ignore the agent's SIGTERM and hold the job for its 30 s grace
        self._kill([r for r, state in states.items() if state not in ("gone", "elsewhere", "unknown")])

    # ---- the other ranks' processes (same host only) -------------------------------------------------------
    def _local_state(self, rank: int) -> str:
        """"stopped", "gone", "running" (or sleeping, in I/O...), "elsewhere" (another host) or "unknown"."""
        if rank >= len(self._processes):
            return "unknown"
        host, pid = self._processes[rank]
        if host != socket.gethostname():
            return "elsewhere"
        return process_state(pid)

    def _describe(self, rank: int, state: str) -> str:
        if state in ("elsewhere", "unknown"):
            return ""  # the diagnosis says "dead, or stuck without releasing the GIL"
        pid = self._processes[rank][1]
        return {"stopped": f"its process (pid {pid}) is stopped (SIGSTOP, Ctrl-Z or a debugger); killed with "
                           f"SIGKILL, since it cannot honour the launcher's SIGTERM",
                "gone": f"its process (pid {pid}) has exited"}.get(
            state, f"its process (pid {pid}) runs but did not report (stuck without releasing the GIL?); killed "
                   f"with SIGKILL")

    def _kill(self, ranks: list[int]) -> None:
        """SIGKILL these ranks' processes `KILL_DELAY_S` after this process exits (the caller exits now): the
        agent must see this rank's failure, with the diagnosis in its error file, first (it reports the one
        failure it sees first, and a killed rank has no message). A detached `sh` does it: a stopped
        process can neither exit nor die of SIGTERM meanwhile, so its pid stays its own."""
        pids = [str(self._processes[rank][1]) for rank in ranks]
        if not pids:
            return
        try:
            subprocess.Popen(["/bin/sh", "-c", f"sleep {KILL_DELAY_S:g}; kill -KILL {' '.join(pids)} 2>/dev/null"],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
        except OSError:  # no shell: kill them now
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        log.error(f"hang watchdog: killing {format_ranks(ranks)} (pid {', '.join(pids)}), which wrote no report, "
                  f"with SIGKILL")

    # ---- stragglers ---------------------------------------------------------------------------------------
    def _report_stragglers(self, trainer: Any) -> None:
        steps, self._steps = self._steps, []
        if trainer.strategy.world_size < 2 or not steps:
            return
        started = time.perf_counter()
        first = steps[0][1]
        entries = flight_recorder_entries()
        # a full ring may have dropped the first steps' records: those steps are judged on no data
        wrapped = len(entries) >= flight_recorder_capacity() > 0
        covered_from = min((entry.get("time_created_ns") or 0 for entry in entries), default=0) if wrapped else 0
        recent = [entry for entry in entries if (entry.get("time_created_ns") or 0) >= first]
        arrivals = [(e["pg"], e["seq"], e["created_ns"]) for e in (normalize_fr_entry(x, {}) for x in recent)
                    if not e["p2p"]]
        gathered = trainer.strategy.all_gather_object({"steps": steps, "arrivals": arrivals,
                                                       "covered_from": covered_from,
                                                       "read_s": time.perf_counter() - started})
        metrics, warning = straggler_metrics(gathered, self.straggler_margin, self._slow_streak,
                                             self.straggler_steps)
        self._next_report = trainer.step + report_interval(gathered, self.straggler_overhead)
        if warning is not None:
            self.straggler_warnings.append(warning)
            if trainer.is_global_zero:
                log.warning(warning)
        trainer.log(metrics)


def report_interval(gathered: list[dict[str, Any]], overhead: float) -> int:
    """Steps until the next straggler report may run: the slowest rank's read of its flight recorder (the
    report's cost) over `overhead` times the median step time, from the figures every rank gathered (so
    every rank computes the same number); 0 with `overhead` 0 (every log step)."""
    durations = sorted((end - start) / 1e9 for rank_data in gathered for _, start, end in rank_data["steps"])
    if overhead <= 0 or not durations:
        return 0
    cost = max(rank_data.get("read_s", 0.0) for rank_data in gathered)
    return math.ceil(cost / (overhead * max(statistics.median(durations), 1e-6)))


def straggler_metrics(gathered: list[dict[str, Any]], margin: float, streak: dict[int, int],
                      needed: int) -> tuple[dict[str, float], str | None]:
    """Per-rank compute and wait seconds of the steps in `gathered` (one entry per rank), the straggler
    streaks updated in place, and the metrics and warning of this log step."""
    world = len(gathered)
    last_arrival: dict[tuple[str, int], int] = {}
    for rank_data in gathered:
        for pg, seq, created in rank_data["arrivals"]:
            key = (pg, seq)
            last_arrival[key] = max(last_arrival.get(key, created), created)
    # steps that started before the oldest record some rank's ring still holds: their arrivals are gone
    covered_from = max((rank_data.get("covered_from", 0) for rank_data in gathered), default=0)
    steps = sorted({s for rank_data in gathered for s, start, _ in rank_data["steps"] if start >= covered_from})
    compute: dict[int, list[float]] = {r: [] for r in range(world)}
    wait: dict[int, list[float]] = {r: [] for r in range(world)}
    worst: tuple[int, int, float, float] | None = None  # rank, streak, compute, median
    for step in steps:
        step_compute: dict[int, float] = {}
        for rank, rank_data in enumerate(gathered):
            window = next(((start, end) for s, start, end in rank_data["steps"] if s == step), None)
            if window is None:
                continue
            start, end = window
            gaps = [last_arrival[(pg, seq)] - created for pg, seq, created in rank_data["arrivals"]
                    if start <= created <= end]
            waited = min(max(gaps, default=0), end - start) / 1e9
            wait[rank].append(waited)
            step_compute[rank] = (end - start) / 1e9 - waited
            compute[rank].append(step_compute[rank])
        if len(step_compute) < 2:
            continue
        for rank, seconds in step_compute.items():
            median = statistics.median(v for r, v in step_compute.items() if r != rank)  # of the others
            slow = seconds > median * (1 + margin) and seconds - median > STRAGGLER_FLOOR_S
            streak[rank] = streak.get(rank, 0) + 1 if slow else 0
            if streak[rank] >= needed and (worst is None or seconds / max(median, 1e-9) > worst[2] / max(worst[3], 1e-9)):
                worst = (rank, streak[rank], seconds, median)
    mean = {r: statistics.fmean(v) for r, v in compute.items() if v}
    mean_wait = {r: statistics.fmean(v) for r, v in wait.items() if v}
    metrics: dict[str, float] = {
        "compute_s_median": statistics.median(mean.values()) if mean else 0.0,
        "wait_s_median": statistics.median(mean_wait.values()) if mean_wait else 0.0,
        "straggler_rank": float(worst[0]) if worst else -1.0,
        "straggler_slowdown": worst[2] / max(worst[3], 1e-9) if worst else 0.0,
    }
    if world <= PER_RANK_METRICS_MAX_WORLD:
        metrics.update({f"compute_s/rank_{r}": v for r, v in mean.items()})
        metrics.update({f"wait_s/rank_{r}": v for r, v in mean_wait.items()})
    warning = None
    if worst is not None:
        rank, count, seconds, median = worst
        warning = (f"straggler: rank {rank} computed {seconds:.3f} s per step against a median of {median:.3f} s "
                   f"(+{100 * (seconds / max(median, 1e-9) - 1):.0f}%) for {count} consecutive steps up to step "
                   f"{steps[-1]}; the other ranks wait for it")
    return metrics, warning


def write_report(hang_dir: Path, report: dict[str, Any]) -> None:
    """rank_R.json (for the diagnosis) and rank_R.txt (for a person) of one rank."""
    rank = report["rank"]
    (hang_dir / f"rank_{rank}.json").with_suffix(".tmp").write_text(json.dumps(report))
    lines = [f"rank {rank}: no progress for {report['allowed_s']:g} s during {report['phase']} "
             f"(step {report['step']}, forward {report['microbatch']} of the step)",
             f"main thread: {report['location']}", ""]
    for name, stack in report["stacks"].items():
        lines += [f"--- thread {name}", *[line.rstrip() for line in stack], ""]
    lines.append("--- last collectives (flight recorder: process group, sequence number, op, sizes, issued, state; "
                 "gloo's entries stay `scheduled`, `retired` tells whether one completed)")
    for e in report["collectives"][-50:]:
        done = "" if e.get("pending") is None else (" (not completed)" if e["pending"] else " (completed)")
        lines.append(f"{e['group']} #{e['seq']} {e['op']} {e['sizes']} issued {e['created_ns']} {e['state']}{done}")
    lines.append("--- pipeline sends/receives (step, index towards the peer, bytes, issued, finished)")
    for r in report["p2p"][-50:]:
        lines.append(f"{r['op']} {'to' if r['op'] == 'send' else 'from'} rank {r['peer']} ({r['group']}) step "
                     f"{r['step']} #{r['index']} {r['bytes']} B issued {r['created_ns']} "
                     f"finished {r['finished_ns'] if r['finished_ns'] is not None else 'NO (pending)'}")
    (hang_dir / f"rank_{rank}.txt").write_text("\n".join(lines) + "\n")
    (hang_dir / f"rank_{rank}.json").with_suffix(".tmp").rename(hang_dir / f"rank_{rank}.json")


def process_state(pid: int) -> str:
    """A local process's state from /proc: "stopped" (T, t), "gone" (no such process, or a zombie),
    "running" otherwise (R, S, D...); "unknown" without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return "unknown"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "running")


def _write_error_file(message: str) -> None:
    """What torch's @record writes for an exception: the launcher then reports this message."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}
    with open(path, "w") as f:
        json.dump(data, f)
