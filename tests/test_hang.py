"""Hangs and stragglers (issue 16): the diagnosis from the ranks' reports, the straggler arithmetic, and
4-process jobs with injected faults (tests/helpers.py) that must end with a diagnosis naming the rank, the
operation and the group, then restart (trainer.max_restarts=1), resume and finish.

The jobs run at once (three `python -m trainer` processes of 4 workers, one of 2) to save CI time; nothing
here asserts a duration: a hang test checks the diagnosis and that the job ended and finished after its
restart (a frozen rank: that the watchdog killed it, rather than the agent after its 30 s grace).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tests.launch_pool import POOL
from trainer.collectives import normalize_fr_entry
from trainer.commcheck import format_table
from trainer.config import ConfigError, compose, validate
from trainer.diagnosis import diagnose, format_ranks
from trainer.hang import process_state, report_interval, straggler_metrics
from trainer.launch import describe_failure

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden_dim=128"]
LOOP = ["trainer.seq_len=32", "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.log_every=1",
        "trainer.val_every=0", "trainer.val_batches=1", "lr_schedule.warmup_steps=2", "data.max_bytes=200000",
        "trainer.peak_flops=1e12", "trainer.num_threads=1", "trainer.devices=4",
        "callbacks=[checkpoint]", "callbacks.checkpoint.every_n_steps=2",
        "trainer.hang_timeout_s=10", "trainer.max_restarts=1"]
DP4 = ["strategy=ddp"]
PP2_DP2 = ["strategy=3d", "pp=2", "tp=1"]  # ranks 0, 1: stage 0 (dp ranks 0, 1); ranks 2, 3: stage 1
STRAGGLER_FROM = 106  # the slowed rank sleeps in each forward from this step on
STRAGGLER_STEPS = 115


def helper(name: str, cls: str, **options: Any) -> list[str]:
    return [f"+callbacks.{name}._target_=tests.helpers.{cls}"] + [f"+callbacks.{name}.{k}={v}" for k, v in options.items()]


JOBS = {
    # a rank that stops before its step's collectives (attempt 0), then 100+ normal steps and a rank slowed
    # from STRAGGLER_FROM on (attempt 1): the straggler report's checks
    # (a report at every log step: the test reads each step's figures)
    "stop_dp4": DP4 + [f"trainer.max_steps={STRAGGLER_STEPS}", "trainer.straggler_overhead=0"]
    + helper("stop", "StopBeforeCollective", rank=2, step=3)
    + helper("slow", "SleepInForward", rank=3, step=STRAGGLER_FROM, seconds=0.25, attempt=1),
    # a rank that sleeps inside the forward (pp2 x dp2, the last stage of dp rank 1)
    "sleep_pp2_dp2": PP2_DP2 + ["trainer.max_steps=6"] + helper("sleep", "SleepInForward", rank=3, step=3),
    # a pipeline stage that skips its send of micro-batch 1 (pp2 x dp2, stage 0 of dp rank 1)
    "skip_send_pp2_dp2": PP2_DP2 + ["trainer.max_steps=6"] + helper("skip", "SkipPipelineSend", rank=1, step=3,
                                                                      microbatch=1),
    # a frozen rank (SIGSTOP) in a 2-process ddp run, before its last backward of step 3: rank 0 waits in
    # DDP's bucket all-reduce, issued from autograd's hooks while its Python stack is in the backward
    "freeze_ddp2": DP4 + ["trainer.devices=2", "trainer.max_steps=6"] + helper("freeze", "FreezeRank", rank=1,
                                                                               step=3, backward=2),
}


# ---- the diagnosis, from hand-made reports ---------------------------------------------------------------
def report(rank: int, *, location: str = "x.py:1 (f)", collectives: list | None = None, p2p: list | None = None,
           stage: int = 0, groups: dict | None = None) -> dict[str, Any]:
    return {"rank": rank, "step": 7, "phase": "step 7", "location": location, "pp_stage": stage,
            "collectives": collectives or [], "p2p": p2p or [], "groups": groups or {}}


def coll(seq: int, op: str = "all_reduce", pg: str = "1", group: str = "dp", pending: bool = False) -> dict[str, Any]:
    return {"op": op, "pg": pg, "group": group, "seq": seq, "p2p": False, "pending": pending, "created_ns": seq}


def test_format_ranks() -> None:
    assert format_ranks([2]) == "rank 2"
    assert format_ranks([0, 1, 2]) == "ranks 0-2"
    assert format_ranks([3, 0, 1]) == "ranks 0, 1 and 3"


def test_diagnosis_names_the_rank_that_never_entered_the_collective() -> None:
    groups = {"1": {"name": "dp", "ranks": [0, 1, 2, 3]}}
    reports = {r: report(r, collectives=[coll(4470), coll(4471)], groups=groups) for r in (0, 1, 3)}
    reports[2] = report(2, location="tests/helpers.py:9 (on_train_batch_start)", collectives=[coll(4470)],
                        groups=groups)
    text = diagnose(reports, 4, 600.0, "run/hang")
    assert text.startswith("hang: no progress within 600 s during step 7: ")
    assert "ranks 0, 1 and 3 wait in all_reduce #4471 of the dp group" in text
    assert ("rank 2 never entered all_reduce #4471 of the dp group (its last in that group is #4470): it is in "
            "tests/helpers.py:9 (on_train_batch_start)") in text
    assert text.endswith("Stacks and last collectives of each rank: run/hang/rank_R.txt.")


def test_diagnosis_names_the_pipeline_receive_and_the_send_that_never_came() -> None:
    recv = {"op": "recv", "peer": 2, "step": 112, "index": 5, "group": "pp", "created_ns": 1, "finished_ns": None}
    sent = {"op": "send", "peer": 3, "step": 112, "index": 4, "group": "pp", "created_ns": 0, "finished_ns": 1}
    reports = {3: report(3, p2p=[recv], stage=1), 2: report(2, p2p=[sent], stage=0, location="model.py:5 (forward)")}
    text = diagnose(reports, 4, 60.0)
    assert ("rank 3 is in the pipeline receive (activations) from rank 2 for micro-batch 5 of step 112 (pp group), "
            "which rank 2 never sent") in text
    assert "rank 2 is not in a collective: it is in model.py:5 (forward)" in text
    assert "ranks 0 and 1 wrote no report" in text


def test_diagnosis_with_every_collective_entered_names_where_each_rank_is() -> None:
    reports = {r: report(r, collectives=[coll(3)], location=f"loop.py:{r} (fit)") for r in range(2)}
    text = diagnose(reports, 2, 5.0)
    assert "rank 0 is not in a collective: it is in loop.py:0 (fit)" in text and "never entered" not in text


AUTOGRAD = ("trainer/interfaces/strategy.py:303 (microbatch_backward), inside torch's autograd/graph.py:979 "
            "(_engine_run_backward)")


def test_diagnosis_names_the_collective_issued_from_autograd_and_the_rank_without_report() -> None:
    """A frozen rank 1 writes nothing; rank 0's Python stack is in the backward, its flight recorder holds
    DDP's bucket all-reduces (#27 and #28) that have not completed."""
    groups = {"1": {"name": "dp_replicate", "ranks": [0, 1]}}
    reports = {0: report(0, location=AUTOGRAD, groups=groups,
                         collectives=[coll(26, "broadcast"), coll(27, pending=True), coll(28, pending=True)])}
    text = diagnose(reports, 2, 20.0, "run/hang", {1: "its process (pid 812) is stopped"})
    assert "rank 0 waits in all_reduce #27 of the dp_replicate group for rank 1, which wrote no report" in text, text
    assert "rank 1 wrote no report: its process (pid 812) is stopped" in text
    assert "not in a collective" not in text
    # without rank 0's knowledge of rank 1's process: the generic reasons
    assert "rank 1 wrote no report (dead, or stuck without releasing the GIL)" in diagnose(reports, 2, 20.0)


def test_diagnosis_reads_past_an_unfinished_collective_of_a_background_write() -> None:
    """An asynchronous checkpoint's write issued a scatter on its own group (members unknown to the reports)
    before the frozen rank 1 stopped: rank 0's older pending entry tells nothing, DDP's newer all-reduce
    does (seen in CI: the run's default asynchronous saves turned the diagnosis into "not in a collective")."""
    groups = {"1": {"name": "dp_replicate", "ranks": [0, 1]}}
    background = {**coll(5, "scatter", pg="7", group="group 7", pending=True), "created_ns": 1}
    reports = {0: report(0, location=AUTOGRAD, groups=groups,
                         collectives=[coll(29, "broadcast"), background, coll(30, pending=True)])}
    text = diagnose(reports, 2, 20.0, "run/hang", {1: "its process (pid 812) is stopped"})
    assert "rank 0 waits in all_reduce #30 of the dp_replicate group for rank 1, which wrote no report" in text, text
    assert "not in a collective" not in text


def test_diagnosis_names_whom_the_ranks_in_an_unfinished_collective_wait_for() -> None:
    groups = {"1": {"name": "dp", "ranks": [0, 1, 2, 3]}}
    # ranks 0, 2 and 3 all issued #9 (so sequence numbers alone name nobody); rank 1 wrote nothing
    reports = {r: report(r, location=AUTOGRAD, groups=groups, collectives=[coll(8), coll(9, pending=True)])
               for r in (0, 2, 3)}
    text = diagnose(reports, 4, 20.0)
    assert "ranks 0, 2 and 3 wait in all_reduce #9 of the dp group for rank 1, which wrote no report" in text, text
    # a rank behind in the group (its last is #8) is the one waited for, and named with where it is
    groups = {"1": {"name": "dp", "ranks": [0, 1]}}
    behind = report(1, location="model.py:5 (forward)", groups=groups, collectives=[coll(8)])
    ahead = report(0, location=AUTOGRAD, groups=groups, collectives=[coll(8), coll(9, pending=True)])
    text = diagnose({1: behind, 0: ahead}, 2, 20.0)
    assert "rank 0 waits in all_reduce #9 of the dp group" in text, text
    assert ("rank 1 never entered all_reduce #9 of the dp group (its last in that group is #8): it is in "
            "model.py:5 (forward)") in text, text


def test_an_unfinished_collective_every_member_issued_names_no_waiting() -> None:
    """A work not yet released (every member issued it) says nothing about where a rank waits."""
    groups = {"1": {"name": "dp", "ranks": [0, 1]}}
    reports = {r: report(r, location=f"loop.py:{r} (fit)", groups=groups, collectives=[coll(5, pending=True)])
               for r in range(2)}
    text = diagnose(reports, 2, 20.0)
    assert "rank 0 is not in a collective: it is in loop.py:0 (fit)" in text and " waits in " not in text


def test_flight_recorder_entries_that_have_not_completed() -> None:
    """gloo's entries stay `scheduled`: `retired` (the work done and released) tells; NCCL has a state."""
    def entry(**fields: Any) -> dict[str, Any]:
        return normalize_fr_entry({"process_group": ("1", ""), "profiling_name": "gloo:all_reduce",
                                   "collective_seq_id": 9, "state": "scheduled", **fields}, {"1": "dp"})
    assert entry(retired=False)["pending"] and not entry(retired=True)["pending"]
    assert entry(retired=False)["group"] == "dp" and entry(retired=False)["op"] == "all_reduce"
    assert not entry(state="completed", retired=False)["pending"] and entry(state="started", retired=False)["pending"]
    assert not entry()["pending"]  # a recorder without the field: nothing is claimed


def test_process_state_tells_a_stopped_process_from_a_running_and_a_gone_one() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert process_state(child.pid) == "running"
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(child.pid) == "stopped"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "gone"


def failure(tmp_path: Path, rank: int, exitcode: int, message: str = "") -> ProcessFailure:
    error_file = tmp_path / f"error_{rank}.json"
    if message:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "",
                                                                                      "timestamp": str(rank)}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file))


def test_a_failed_job_is_one_line_per_cause(tmp_path: Path) -> None:
    killed = ChildFailedError("worker_main", {1: failure(tmp_path, 1, -9)})
    assert describe_failure(killed).startswith("rank 1 failed: killed by signal 9 (SIGKILL)")
    raised = ChildFailedError("worker_main", {0: failure(tmp_path, 0, 1, "RuntimeError: boom"),
                                              2: failure(tmp_path, 2, 1, "RuntimeError: boom"),
                                              3: failure(tmp_path, 3, -9)})
    lines = describe_failure(raised).splitlines()
    assert lines[0].startswith("ranks 0, 2 failed: RuntimeError: boom") and len(lines) == 2, lines
    assert lines[1] == "rank 3 failed: killed by signal 9 (SIGKILL)"
    # a hang diagnosis, whichever rank's failure the agent saw first
    hang = ChildFailedError("worker_main", {1: failure(tmp_path, 1, -9),
                                            0: failure(tmp_path, 0, 1, "hang: rank 0 ...")})
    assert describe_failure(hang) == "hang: rank 0 ..."


# ---- stragglers -----------------------------------------------------------------------------------------
def rank_data(step_s: list[float], late_s: list[float]) -> dict[str, Any]:
    """One rank's steps (1 s apart) with one collective each, which this rank reaches `late_s` after the
    step start (its compute) and every rank leaves at the same time."""
    steps, arrivals = [], []
    for i, (length, late) in enumerate(zip(step_s, late_s, strict=True)):
        start = int(i * 1e9)
        steps.append((i + 1, start, start + int(length * 1e9)))
        arrivals.append(("1", i + 1, start + int(late * 1e9)))
    return {"steps": steps, "arrivals": arrivals}


def test_straggler_is_the_rank_the_others_wait_for_several_steps() -> None:
    normal = rank_data([0.5] * 6, [0.1] * 6)
    slow = rank_data([0.5] * 6, [0.1, 0.1, 0.4, 0.4, 0.4, 0.4])  # computes 0.4 s from step 3 on
    streak: dict[int, int] = {}
    metrics, warning = straggler_metrics([normal, normal, slow, normal], 0.5, streak, 3)
    assert metrics["straggler_rank"] == 2 and warning is not None and warning.startswith("straggler: rank 2 ")
    assert metrics["wait_s/rank_0"] > metrics["wait_s/rank_2"] == 0.0
    assert metrics["compute_s/rank_2"] > metrics["compute_s/rank_0"]
    # two slow steps are not enough
    _, warning = straggler_metrics([normal, normal, rank_data([0.5] * 6, [0.1] * 4 + [0.4] * 2), normal], 0.5, {}, 3)
    assert warning is None


def test_straggler_streaks_continue_across_log_steps() -> None:
    streak: dict[int, int] = {}
    normal, slow = rank_data([0.5] * 2, [0.1] * 2), rank_data([0.5] * 2, [0.4] * 2)
    assert straggler_metrics([normal, slow], 0.5, streak, 3)[1] is None
    metrics, warning = straggler_metrics([normal, slow], 0.5, streak, 3)
    assert warning is not None and metrics["straggler_rank"] == 1


def test_steps_whose_records_the_ring_dropped_are_left_out() -> None:
    # rank 1 computes 0.4 s in steps 1-2 only; its ring's oldest record is from step 3 on (covered_from), so
    # those steps are judged on no data rather than on missing arrivals (which read as no waiting)
    normal, slow = rank_data([0.5] * 4, [0.1] * 4), rank_data([0.5] * 4, [0.4, 0.4, 0.1, 0.1])
    assert straggler_metrics([normal, slow], 0.5, {}, 2)[1] is not None
    slow["covered_from"] = int(2e9)
    metrics, warning = straggler_metrics([normal, slow], 0.5, {}, 2)
    # rank 0 waited 0.3 s in steps 1-2 (compute 0.2 s): only steps 3-4 count, where nobody waits
    assert warning is None and metrics["compute_s/rank_0"] == pytest.approx(0.5)


def test_a_report_waits_for_steps_worth_its_cost_over_the_allowed_share() -> None:
    steps = rank_data([0.05] * 3, [0.0] * 3)
    cheap, costly = {**steps, "read_s": 0.001}, {**steps, "read_s": 0.03}
    # the slowest rank's read (30 ms) over 1% of a 50 ms step: 60 steps, on every rank alike
    assert report_interval([cheap, costly], 0.01) == report_interval([costly, cheap], 0.01) == 60
    assert report_interval([cheap, costly], 0.0) == 0  # every log step
    assert report_interval([{**steps, "read_s": 0.0}], 0.01) == 0


# ---- config and the check table ---------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "key"), [("trainer.hang_timeout_s=-1", "trainer.hang_timeout_s"),
                                               ("trainer.hang_first_step_factor=0.5", "trainer.hang_first_step_factor"),
                                               ("trainer.straggler_steps=0", "trainer.straggler_steps"),
                                               ("trainer.straggler_overhead=1", "trainer.straggler_overhead")])
def test_watchdog_options_are_validated(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        validate(compose([override]))


def test_check_table_shows_the_slowest_group_of_each_dimension() -> None:
    rows = [[{"group": "dp", "size": 2, "ranks": [0, 1], "latency_us": 50.0, "algbw_gbs": 2.0, "busbw_gbs": 2.0}],
            [{"group": "dp", "size": 2, "ranks": [2, 3], "latency_us": 80.0, "algbw_gbs": 1.0, "busbw_gbs": 1.0}]]
    table = format_table(rows, 16)
    row = next(line for line in table.splitlines() if line.startswith("dp "))
    assert row.split() == ["dp", "2", "80.0", "1.000", "1.000", "[2,", "3]"]


# ---- 4-process jobs with injected faults ------------------------------------------------------------------
# The jobs run in a process of their own, started when the session's shared launches have ended (10 s hang
# timeouts and straggler timings: not beside them) and running beside the session's remaining tests.
JOBS_DIR = POOL.jobs_root / "hang"
RUN_JOBS = """import json, os, subprocess, sys
from pathlib import Path
out, commands = Path(sys.argv[1]), json.loads(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
env = {**os.environ, "OMP_NUM_THREADS": "1"}
running = {name: subprocess.Popen(command, stdout=open(out / f"{name}.out", "w"), stderr=subprocess.STDOUT, env=env)
           for name, command in commands.items()}
for name, process in running.items():
    (out / f"{name}.rc").write_text(str(process.wait(timeout=900)))
"""


def _job_commands() -> dict[str, list[str]]:
    commands = {}
    for name, overrides in JOBS.items():
        own = {override.split("=")[0] for override in overrides}
        loop = [override for override in LOOP if override.split("=")[0] not in own]  # a job's own value wins
        commands[name] = [sys.executable, "-m", "trainer", *MODEL, *loop, *overrides, f"hydra.run.dir={JOBS_DIR / name}"]
    return commands


POOL.add_job("hang", [sys.executable, "-c", RUN_JOBS, str(JOBS_DIR), json.dumps(_job_commands())], after_launches=True)


@pytest.fixture(scope="module")
def jobs() -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    code, output = POOL.job("hang")
    assert code == 0, output
    return {name: (JOBS_DIR / name, subprocess.CompletedProcess(command, int((JOBS_DIR / f"{name}.rc").read_text()),
                                                                 (JOBS_DIR / f"{name}.out").read_text(), ""))
            for name, command in _job_commands().items()}


def finished_after_restart(run_dir: Path, result: subprocess.CompletedProcess, steps: int,
                           reporting: range = range(4)) -> str:
    """The job's first attempt ended on the hang, the second resumed and finished: the diagnosis."""
    assert result.returncode == 0, result.stdout[-4000:]
    log = (run_dir / "train.log").read_text()
    assert "(restart 1)" in log, log[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
    reports = sorted(p.name for p in (run_dir / "hang.attempt0").glob("rank_*.txt"))
    assert reports == [f"rank_{r}.txt" for r in reporting]
    diagnosis = (run_dir / "hang.attempt0" / "diagnosis.txt").read_text().strip()
    assert diagnosis in log  # rank 0 logged it before the job ended
    return diagnosis


@pytest.mark.slow
def test_a_rank_that_stops_before_a_collective_is_named(jobs: dict) -> None:
    diagnosis = finished_after_restart(*jobs["stop_dp4"], STRAGGLER_STEPS)
    assert diagnosis.startswith("hang: no progress within 10 s during step 3: ")
    # the others wait in DDP's collectives of the (whole-world) data-parallel group; rank 2 never came
    assert re.search(r"rank 2 never entered (all_reduce|broadcast) #\d+ of the dp_replicate group "
                     r"\(its last in that group is #\d+\): it is in tests/helpers.py:\d+ \(on_train_batch_start\)",
                     diagnosis), diagnosis
    assert re.search(r"ranks? [0-9, and-]+ waits? in (all_reduce|broadcast) #\d+ of the dp_replicate group", diagnosis)
    rank_2 = (jobs["stop_dp4"][0] / "hang.attempt0" / "rank_2.txt").read_text()
    assert "time.sleep(3600)" in rank_2 and "--- thread hang-watchdog" not in rank_2  # stacks, minus its own


@pytest.mark.slow
def test_a_rank_that_sleeps_in_the_forward_is_named(jobs: dict) -> None:
    diagnosis = finished_after_restart(*jobs["sleep_pp2_dp2"], 6)
    # rank 3 (last stage) sleeps in its first forward of step 3: stage 0 of its pipeline waits for its
    # gradients, and its data-parallel peer (rank 2) waits for it in a collective of the dp group
    assert re.search(r"rank 3 never entered \w+ #\d+ of the dp_shard group \(its last in that group is #\d+\): "
                     r"it is in tests/helpers.py:\d+ \(_sleep\)", diagnosis), diagnosis
    assert "rank 1 is in the pipeline receive (gradients) from rank 3 for micro-batch 0 of step 3 (pp group)" in diagnosis
    assert re.search(r"rank 2 waits in \w+ #\d+ of the dp_shard group", diagnosis), diagnosis


@pytest.mark.slow
def test_a_pipeline_stage_that_skips_a_send_is_named(jobs: dict) -> None:
    diagnosis = finished_after_restart(*jobs["skip_send_pp2_dp2"], 6)
    assert ("rank 3 is in the pipeline receive (activations) from rank 1 for micro-batch 1 of step 3 (pp group), "
            "which rank 1 never sent") in diagnosis, diagnosis
    assert re.search(r"rank 3 never entered \w+ #\d+ of the dp_shard group \(its last in that group is #\d+; "
                     r"it is in the pipeline receive above\)", diagnosis), diagnosis


@pytest.mark.slow
def test_a_frozen_rank_is_named_and_killed_and_the_collective_waited_in_is_named(jobs: dict) -> None:
    run_dir, result = jobs["freeze_ddp2"]
    diagnosis = finished_after_restart(run_dir, result, 6, reporting=range(1))  # the frozen rank 1 wrote none
    assert diagnosis.startswith("hang: no progress within 10 s during step 3: ")
    # rank 0's stack is in autograd's backward; the flight recorder's unfinished entry is DDP's all-reduce
    assert re.search(r"rank 0 waits in all_reduce #\d+ of the dp_replicate group for rank 1, which wrote no report",
                     diagnosis), diagnosis
    assert re.search(r"rank 1 wrote no report: its process \(pid \d+\) is stopped .* killed with SIGKILL", diagnosis)
    assert "(_engine_run_backward)" in (run_dir / "hang.attempt0" / "rank_0.txt").read_text()
    # killed by the watchdog, not left to the agent's SIGTERM and its 30 s grace (which ends in the agent's
    # "Unable to shutdown process ... forcefully exiting via Signals.SIGKILL", seen before this was built)
    assert re.search(r"hang watchdog: killing rank 1 \(pid \d+\), which wrote no report, with SIGKILL",
                     (run_dir / "train.log").read_text())
    assert "Unable to shutdown process" not in (run_dir / "launcher.log").read_text()
    # the console: the diagnosis, not the elastic agent's tracebacks (in the launcher's log)
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    assert "Traceback" in (run_dir / "launcher.log").read_text()


@pytest.mark.slow
def test_a_slowed_rank_is_named_as_straggler_and_normal_steps_are_not(jobs: dict) -> None:
    run_dir, _ = jobs["stop_dp4"]
    log = (run_dir / "train.log").read_text()
    warnings = re.findall(r"straggler: rank (\d+) .* up to step (\d+);", log)
    assert warnings, log[-3000:]
    assert all(rank == "3" for rank, _ in warnings)
    first = int(warnings[0][1])
    assert STRAGGLER_FROM <= first < STRAGGLER_FROM + 10  # within 10 steps, never before
    with open(run_dir / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("straggler_rank")]
    named = {int(row["step"]): int(float(row["straggler_rank"])) for row in rows}
    # 100+ normal steps after the restart (steps 3..105) name no straggler
    assert [step for step, rank in named.items() if rank != -1 and step < STRAGGLER_FROM] == []
    assert len([step for step in named if 3 <= step < STRAGGLER_FROM]) >= 100
    assert named[first] == 3
    assert float(next(r for r in rows if int(r["step"]) == first)["compute_s/rank_3"]) > 0.2
