"""Recovery from a killed rank: the time a fault costs with disk checkpoints only vs with in-memory snapshots,
and how long a checkpoint save holds the training loop up, asynchronous vs synchronous.

Three `python -m trainer` jobs, each `--devices` gloo processes started by the trainer's own launcher
(trainer/launch.py: torch's elastic agent, `trainer.max_restarts`), `--strategy` zero3 by default (each rank
holds a quarter of the weights and optimizer states), a byte-level Llama of `--dim` x `--layers` (1024 x 4 by default: 52M parameters, a 0.62 GB checkpoint of fp32
weights and AdamW's two moments):

1. `disk`: checkpoints every `--disk-every` (50) steps only. Rank 1 SIGKILLs itself at the end of each step of
   `--faults` (12, 27, 44: one fault per elastic attempt; max_restarts = 3); each restart resumes from the
   latest complete checkpoint, which before step 50 means from step 0.
2. `memory`: the same plus in-memory snapshots every `--memory-every` (5) steps (`callbacks.checkpoint.
   in_memory_every`); each restart resumes from the newest snapshot (steps 10, 25, 40).
3. `saves`: no fault; saves at `--save-steps` (3, 6, 9, 12), alternately asynchronous and synchronous
   (ABAB in one run, so that drift in the machine's load hits both kinds alike).

Time lost to a fault: from the kill (the killed rank records the time just before SIGKILL) to the end of the
same step in the next attempt, on rank 0. Its parts: detection (until the elastic agent decides to restart:
`faults.jsonl`), restart (new processes, imports, rendezvous, model build: until the restore starts), restore
(`resume`: reading a checkpoint or a snapshot; nothing to read without one), recompute (from the restore's end
to the fault's step again: the steps since the resumed state, the first step's warm-up included).
`speedup` = total time lost over the faults, disk / memory. The stall of a save is the checkpoint manager's
own figure (summary.json `checkpoints`): the save call plus any later wait for its background write;
`stall_ratio` = median asynchronous / median synchronous stall.

    python benchmarks/recovery.py                # ~25 minutes on the loaded 2-core VM (docs/BENCHMARKS.md)
    python benchmarks/recovery.py --only memory  # one part: saves | disk | memory | faults (disk + memory)
    python benchmarks/recovery.py --smoke        # a tiny model, to check the script (1-2 minutes)

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from trainer.callback import Callback

REPO = Path(__file__).resolve().parent.parent
EVENTS = "bench_events.jsonl"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _append(run_dir: Path | str, event: dict[str, Any]) -> None:
    """One line per event (small appends from two processes at most: rank 0 and the faulting rank)."""
    with open(Path(run_dir) / EVENTS, "a") as f:
        f.write(json.dumps(event) + "\n")


class StepClock(Callback):
    """Rank 0: the start of each attempt (with the resume's timeline, `trainer.recovery`) and the wall time
    (`time.time()`, comparable across processes) at the end of every step. Listed after the checkpoint
    manager: a step's end includes its save or snapshot."""

    def on_fit_start(self, trainer: Any) -> None:
        if trainer.is_global_zero:
            _append(trainer.run_dir, {"event": "start", "attempt": _attempt(), "step": trainer.step,
                                      "time": time.time(), "recovery": trainer.recovery})

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        if trainer.is_global_zero:
            _append(trainer.run_dir, {"event": "step", "attempt": _attempt(), "step": trainer.step, "time": time.time()})


class FaultInjector(StepClock):
    """Rank `rank` SIGKILLs itself at the end of step `faults[attempt]` of elastic attempt `attempt`, after
    recording the time."""

    def __init__(self, faults: list[int], rank: int = 1) -> None:
        self.faults, self.rank = [int(step) for step in faults], rank

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        super().on_train_batch_end(trainer, outputs)
        attempt = _attempt()
        if trainer.strategy.rank == self.rank and attempt < len(self.faults) and trainer.step == self.faults[attempt]:
            _append(trainer.run_dir, {"event": "fault", "attempt": attempt, "step": trainer.step, "time": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)


class AlternatingSaves(StepClock):
    """Saves through the run's checkpoint manager at `steps`, the first asynchronous, the next synchronous,
    and so on (the manager's own schedule off: `every_n_steps=null`, `save_last=false`)."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = [int(step) for step in steps]

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        from trainer.plugins.callbacks import CheckpointManager

        if trainer.step in self.steps:
            manager = next(c for c in trainer.callbacks if isinstance(c, CheckpointManager))
            manager.save(trainer, "periodic", asynchronous=self.steps.index(trainer.step) % 2 == 0)
        super().on_train_batch_end(trainer, outputs)


# ---- the jobs ---------------------------------------------------------------------------------------------
def common(args: argparse.Namespace) -> list[str]:
    """The model, batch and loop of every job."""
    per_rank = args.batch // args.devices
    return [f"strategy={args.strategy}", f"trainer.devices={args.devices}", f"model.dim={args.dim}",
            f"model.n_layers={args.layers}", f"model.n_heads={args.heads}", f"model.n_kv_heads={args.heads}",
            f"model.ffn_hidden_dim={args.ffn}", f"trainer.seq_len={args.seq_len}", f"trainer.global_batch_size={args.batch}",
            f"trainer.micro_batch_size={per_rank}", "trainer.log_every=1", "trainer.val_every=0", "trainer.val_batches=1",
            "lr_schedule.warmup_steps=2", "data.max_bytes=2000000", "trainer.save_final=false",
            f"trainer.num_threads={args.threads}", "trainer.peak_flops=1e12", "callbacks=[default,checkpoint]",
            "callbacks.checkpoint.save_last=false"]


def run_job(name: str, overrides: list[str], root: Path, args: argparse.Namespace) -> tuple[Path, float]:
    """`python -m trainer` in `root/name`; (its run directory, its wall seconds)."""
    run_dir = root / name
    command = [sys.executable, "-m", "trainer", *common(args), *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} job failed (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"{name}: {seconds:.0f} s", flush=True)
    return run_dir, seconds


def fault_job(name: str, snapshots: Optional[int], root: Path, args: argparse.Namespace) -> tuple[Path, float]:
    faults = ",".join(str(step) for step in args.faults)
    overrides = [f"trainer.max_steps={max(args.faults) + 1}", f"trainer.max_restarts={len(args.faults)}",
                 f"callbacks.checkpoint.every_n_steps={args.disk_every}",
                 "+callbacks.bench._target_=benchmarks.recovery.FaultInjector", f"+callbacks.bench.faults=[{faults}]"]
    if snapshots is not None:
        overrides.append(f"callbacks.checkpoint.in_memory_every={snapshots}")
    return run_job(name, overrides, root, args)


def saves_job(root: Path, args: argparse.Namespace) -> tuple[Path, float]:
    steps = ",".join(str(step) for step in args.save_steps)
    overrides = [f"trainer.max_steps={max(args.save_steps) + 1}", "callbacks.checkpoint.every_n_steps=null",
                 "+callbacks.bench._target_=benchmarks.recovery.AlternatingSaves", f"+callbacks.bench.steps=[{steps}]"]
    return run_job("saves", overrides, root, args)


# ---- the figures ------------------------------------------------------------------------------------------
def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / EVENTS).read_text().splitlines() if line.strip()]


def time_lost(run_dir: Path) -> list[dict[str, Any]]:
    """Per fault: the time lost and its parts (see the module's docstring), from the events and faults.jsonl."""
    events = read_events(run_dir)
    detections = [json.loads(line)["detected"] for line in (run_dir / "faults.jsonl").read_text().splitlines()
                  if line.strip()]
    faults = sorted((e for e in events if e["event"] == "fault"), key=lambda e: e["attempt"])
    figures = []
    for fault, detected in zip(faults, detections, strict=True):
        attempt = fault["attempt"] + 1
        start = next(e for e in events if e["event"] == "start" and e["attempt"] == attempt)
        back = next(e for e in events if e["event"] == "step" and e["attempt"] == attempt and e["step"] == fault["step"])
        timeline = start["recovery"]
        restored = timeline["restore_started"] + timeline["restore_s"]
        figures.append({
            "fault_step": fault["step"], "resumed_step": timeline["resumed_step"],
            "resumed_from": timeline["resumed_from"], "steps_recomputed": fault["step"] - timeline["resumed_step"],
            "lost_s": back["time"] - fault["time"],
            "detection_s": detected - fault["time"],
            "restart_s": timeline["restore_started"] - detected,
            "restore_s": timeline["restore_s"],
            "recompute_s": back["time"] - restored,
        })
    return figures


def step_seconds(events: list[dict[str, Any]]) -> dict[int, float]:
    """Each step's duration on rank 0 (from the previous step's end) in the first attempt; step 1 left out."""
    ends = {e["step"]: e["time"] for e in events if e["event"] == "step" and e["attempt"] == 0}
    return {step: ends[step] - ends[step - 1] for step in sorted(ends) if step - 1 in ends}


def stall_figures(run_dir: Path, save_steps: list[int]) -> dict[str, Any]:
    saves = json.loads((run_dir / "summary.json").read_text())["checkpoints"]["saves"]
    asynchronous = [s for s in saves if s["asynchronous"]]
    synchronous = [s for s in saves if not s["asynchronous"]]
    durations = step_seconds(read_events(run_dir))
    after = {kind: [durations[s["step"] + 1] for s in group if s["step"] + 1 in durations]
             for kind, group in (("asynchronous", asynchronous), ("synchronous", synchronous))}
    # a save step's duration holds its stall (the clock reads after the save), the next one a background write
    plain = [seconds for step, seconds in durations.items() if step - 1 not in save_steps and step not in save_steps]
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    files = json.loads((checkpoint / "checkpoint.json").read_text())["files"]
    async_median = statistics.median(s["stall_s"] for s in asynchronous)
    sync_median = statistics.median(s["stall_s"] for s in synchronous)
    return {
        "checkpoint_bytes": sum(entry["bytes"] for entry in files.values()),
        "async_stall_s": [s["stall_s"] for s in asynchronous], "sync_stall_s": [s["stall_s"] for s in synchronous],
        "async_call_s": [s["call_s"] for s in asynchronous], "async_wait_s": [s["wait_s"] for s in asynchronous],
        "async_write_s": [s["write_s"] for s in asynchronous],
        "async_median_stall_s": async_median, "sync_median_stall_s": sync_median,
        "stall_ratio": async_median / sync_median,
        # a step with a background write beside it (the one right after an asynchronous save) vs others
        "step_s_beside_async_write": after["asynchronous"],
        "step_s_median_without_save": statistics.median(plain) if plain else None,
    }


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences); a multiple of --devices")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--faults", type=lambda text: [int(s) for s in text.split(",")], default=[12, 27, 44])
    parser.add_argument("--disk-every", type=int, default=50)
    parser.add_argument("--memory-every", type=int, default=5)
    parser.add_argument("--save-steps", type=lambda text: [int(s) for s in text.split(",")], default=[3, 6, 9, 12])
    parser.add_argument("--only", choices=["all", "saves", "faults", "disk", "memory"], default="all")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and early faults (checks the script)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    args = parser.parse_args()
    if args.smoke:
        args.dim, args.layers, args.heads, args.ffn, args.seq_len = 64, 2, 4, 128, 32
        args.faults, args.save_steps = [3, 7], [2, 4]
    if max(args.faults) >= args.disk_every:
        print(f"note: a fault at or after step {args.disk_every} resumes from a disk checkpoint in both jobs")

    root = args.keep or Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    params = args.layers * (4 * args.dim * args.dim + 3 * args.dim * args.ffn) + 2 * 256 * args.dim
    report: dict[str, Any] = {"cpu": cpu_model(), "devices": args.devices, "strategy": args.strategy,
                              "parameters_approx": params, "faults": args.faults, "wall_s": {}}
    try:
        if args.only in ("all", "saves"):
            run_dir, report["wall_s"]["saves"] = saves_job(root, args)
            report["saves"] = stall_figures(run_dir, args.save_steps)
            s = report["saves"]
            print(f"checkpoint {s['checkpoint_bytes'] / 1e9:.2f} GB; stall per save: asynchronous median "
                  f"{s['async_median_stall_s']:.2f} s {s['async_stall_s']}, synchronous median "
                  f"{s['sync_median_stall_s']:.2f} s {s['sync_stall_s']}: ratio {s['stall_ratio']:.3f}", flush=True)
        if args.only != "saves":
            for name, snapshots in (("disk", None), ("memory", args.memory_every)):
                if args.only in ("disk", "memory") and name != args.only:
                    continue
                run_dir, report["wall_s"][name] = fault_job(name, snapshots, root, args)
                figures = time_lost(run_dir)
                report[name] = {"per_fault": figures, "lost_s": sum(f["lost_s"] for f in figures)}
                for f in figures:
                    print(f"{name}: fault at step {f['fault_step']} -> resumed at {f['resumed_step']}: lost "
                          f"{f['lost_s']:.1f} s (detection {f['detection_s']:.1f}, restart {f['restart_s']:.1f}, "
                          f"restore {f['restore_s']:.1f}, recompute {f['recompute_s']:.1f} for "
                          f"{f['steps_recomputed']} steps)", flush=True)
            if "disk" in report and "memory" in report:
                report["speedup"] = report["disk"]["lost_s"] / report["memory"]["lost_s"]
                print(f"time lost over {len(args.faults)} faults: disk only {report['disk']['lost_s']:.1f} s, "
                      f"in-memory snapshots {report['memory']['lost_s']:.1f} s: {report['speedup']:.2f}x")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    report["settings"] = {key: value if not isinstance(value, Path) else str(value) for key, value in vars(args).items()}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
