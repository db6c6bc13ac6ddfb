"""Muon against AdamW: optimizer-step time, whole-step time and the loss after the same tokens.

Both sides are this trainer (`optimizer=adamw` and `optimizer=muon`, each with its defaults) on the same
model (the default `tiny`, or whatever the trailing Hydra overrides make of it), data and batches, under
`strategy=zero1` and `strategy=zero3` on `--nproc` gloo processes (4 by default). Started plainly, the script
re-launches itself under `python -m torch.distributed.run --standalone` with OMP_NUM_THREADS=1; the workers
share one gloo process group (the trainer reuses it, as in tests/distributed_harness.py) and run, for each
strategy, `--repeats` rounds of AdamW, Muon, Muon, AdamW (ABBA, so that drifts in machine speed hit both
alike). Each run times, after `--warmup` steps, every optimizer step (`Strategy.optimizer_step`: for zero1
the step of this rank's rows and the all-gather of the updated rows; for Muon also its gathers of whole
matrices and the hand-back of the results) and every whole step (the loop's step, `StepClock`); a run's
figure is the median over its steps of the slowest rank's. Reported (by rank 0): the medians of the runs of
each side, the ratios Muon / AdamW (targets: optimizer step <= 1.5, whole step <= 1.10; reported, never
asserted) and each side's final training loss and validation loss after the same tokens.

    nice -n 19 python benchmarks/muon.py                          # tiny model, zero1 and zero3, 4 processes
    python benchmarks/muon.py --steps 4 --warmup 1 --repeats 1 model.n_layers=2   # smoke test

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.config import compose  # noqa: E402
from trainer.run import build_trainer  # noqa: E402

STRATEGIES = ("zero1", "zero3")
OPTIMIZERS = ("adamw", "muon")
TARGETS = {"optimizer_step": 1.5, "whole_step": 1.10}


def timed_run(overrides: list[str], warmup: int) -> dict[str, float]:
    """One run: median optimizer-step and whole-step seconds after `warmup` steps (slowest rank's), and the
    final training and validation losses."""
    path = [tempfile.mkdtemp(prefix="muon_bench_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    run_dir = Path(path[0])
    trainer = build_trainer(compose(overrides), run_dir)
    clock = StepClock()
    trainer.callbacks.append(clock)
    step_times: list[float] = []
    optimizer_step = trainer.strategy.optimizer_step

    def timed_optimizer_step(optimizer: Any) -> bool:
        # the strategy's whole optimizer step, its collectives included (what a run waits for)
        started = time.perf_counter()
        stepped = optimizer_step(optimizer)
        step_times.append(time.perf_counter() - started)
        return stepped

    trainer.strategy.optimizer_step = timed_optimizer_step  # type: ignore[method-assign]
    summary = trainer.fit()
    whole = [b - a for a, b in zip(clock.times[warmup:], clock.times[warmup + 1:])]
    mine = (statistics.median(step_times[warmup:]), statistics.median(whole))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    result = {"optimizer_step_s": max(o for o, _ in everyone), "whole_step_s": max(w for _, w in everyone),
              "train_loss": float(summary.get("final_train_loss", summary.get("train_loss", float("nan")))),
              "val_loss": float(summary.get("final_val_loss", summary.get("val_loss", float("nan"))))}
    trainer.strategy.teardown()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    base = [f"trainer.devices={world}", f"trainer.max_steps={args.steps}", "trainer.log_every=1",
            f"trainer.val_every={args.steps}", "trainer.val_batches=4", "callbacks=none",
            f"lr_schedule.warmup_steps={max(1, args.steps // 5)}", "trainer.micro_batch_size=4", *args.overrides]
    results: dict[str, dict[str, list[dict[str, float]]]] = {s: {o: [] for o in OPTIMIZERS} for s in STRATEGIES}
    for strategy in STRATEGIES:
        for _ in range(args.repeats):
            for optimizer in ("adamw", "muon", "muon", "adamw"):  # ABBA
                run = timed_run(base + [f"strategy={strategy}", f"optimizer={optimizer}"], args.warmup)
                results[strategy][optimizer].append(run)
                if dist.get_rank() == 0:
                    print(f"{strategy} {optimizer}: optimizer step {run['optimizer_step_s'] * 1e3:.1f} ms, whole "
                          f"step {run['whole_step_s'] * 1e3:.1f} ms, train loss {run['train_loss']:.4f}", flush=True)
    if dist.get_rank() == 0:
        report: dict[str, Any] = {"world_size": world, "steps": args.steps, "warmup": args.warmup,
                                  "repeats": args.repeats, "overrides": args.overrides, "targets": TARGETS}
        for strategy in STRATEGIES:
            row: dict[str, Any] = {}
            for optimizer in OPTIMIZERS:
                runs = results[strategy][optimizer]
                row[optimizer] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            for key in ("optimizer_step", "whole_step"):
                row[f"{key}_ratio"] = row["muon"][f"{key}_s"] / row["adamw"][f"{key}_s"]
            report[strategy] = row
            print(f"{strategy}: Muon / AdamW optimizer step {row['optimizer_step_ratio']:.2f}x (target <= "
                  f"{TARGETS['optimizer_step']}), whole step {row['whole_step_ratio']:.2f}x (target <= "
                  f"{TARGETS['whole_step']}); after the same tokens train loss AdamW {row['adamw']['train_loss']:.4f}"
                  f" Muon {row['muon']['train_loss']:.4f}, val loss AdamW {row['adamw']['val_loss']:.4f} Muon "
                  f"{row['muon']['val_loss']:.4f}", flush=True)
        print(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    parser.add_argument("--repeats", type=int, default=1, help="ABBA rounds per strategy")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides (model, data, trainer)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", f"--steps={args.steps}", f"--warmup={args.warmup}", f"--repeats={args.repeats}",
               *args.overrides]
    raise SystemExit(subprocess.call(command, env={**os.environ, "OMP_NUM_THREADS": "1"}))


if __name__ == "__main__":
    main()
