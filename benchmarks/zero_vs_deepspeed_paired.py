"""Our ZeRO stages against DeepSpeed's, step by step in the same processes: a paired measurement of speed.

`benchmarks/zero_vs_deepspeed.py` times each side in its own launches (what memory needs: a process's peak is
monotone), so the ratio carries the launch-to-launch spread of a shared machine (+-5% per launch on the 2-core
VM). Here one `torchrun` launch per stage builds both sides, with the same settings, model, weights and
batches as there (`build_trainer` for ours, `build_deepspeed` for DeepSpeed), and alternates them one optimizer
step at a time (ours first on even steps, DeepSpeed first on odd ones), each step timed from a barrier to its
end on the slowest rank. A drift in machine speed then hits both sides of every pair alike. The paired ratio
of a step is DeepSpeed's time / ours of the same pair (above 1: ours is faster); the report gives the median
over the steps after `--warmup`, per launch, and the median of those over `--repeats` launches. Memory is not
measured here (both sides share the process): the launch-per-side script reports it.

    python benchmarks/zero_vs_deepspeed_paired.py                    # stages 1-3, tiny model, ~6 min
    python benchmarks/zero_vs_deepspeed_paired.py --stages 1 --repeats 3 --steps 40

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.zero_vs_deepspeed import (  # noqa: E402
    build_deepspeed, deepspeed_installed, deepspeed_microbatches, ours_overrides, shared_run_dir)
from trainer.config import compose  # noqa: E402
from trainer.run import build_trainer  # noqa: E402


def timed_step(step: Callable[[], Any]) -> float:
    """Seconds from a barrier to the end of `step` on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    deepspeed = build_deepspeed(args, threads)
    with shared_run_dir() as run_dir:
        trainer = build_trainer(compose(ours_overrides(args, threads)), run_dir)
        trainer._call("on_fit_start")  # the callbacks a run has (the hang watchdog's thread, its records)

        def ours() -> None:
            trainer.training_step(trainer.strategy.local_batches(next(trainer.train_loader)))

        def theirs() -> None:
            deepspeed_microbatches(deepspeed)

        sides = {"ours": ours, "deepspeed": theirs}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for step in range(args.warmup + args.steps):
            for name in (list(sides) if step % 2 == 0 else list(sides)[::-1]):
                times[name].append(timed_step(sides[name]))
        trainer._call("on_fit_end")
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(times))
        dist.barrier()
        trainer = deepspeed = None  # DDP's reducer and the engine hold the process group: drop them first
        gc.collect()
    dist.destroy_process_group()


def summarize(times: dict[str, list[float]], warmup: int, tokens_per_step: int) -> dict[str, Any]:
    ours, theirs = times["ours"][warmup:], times["deepspeed"][warmup:]
    return {"ours_tokens_per_s": tokens_per_step / statistics.median(ours),
            "deepspeed_tokens_per_s": tokens_per_step / statistics.median(theirs),
            "paired_ratio": statistics.median(d / o for o, d in zip(ours, theirs)),
            "ours_step_s": ours, "deepspeed_step_s": theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per side and launch")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="launches per stage")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--ds-persistence-threshold", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to both sides")
    args = parser.parse_intermixed_args()
    # what zero_vs_deepspeed's helpers read: no variant, and a peak so that the trainer does not measure one
    args.ours_overrides, args.peak_flops = "[]", 1e11
    if args.worker:
        worker(args)
        return
    version, reason = deepspeed_installed()
    if version is None:
        print(json.dumps({"error": reason}))
        raise SystemExit(1)
    cfg = compose(list(args.overrides))
    tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
    stages: dict[str, Any] = {}
    for stage in [int(s) for s in args.stages.split(",") if s]:
        launches = []
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                result = Path(tmp) / "times.json"
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={args.nproc}", __file__, "--worker", f"--stage={stage}",
                           f"--result={result}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                           f"--micro-batch-size={args.micro_batch_size}", f"--bucket-mb={args.bucket_mb}",
                           f"--ds-persistence-threshold={args.ds_persistence_threshold}", *args.overrides]
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                       "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0 or not result.exists():
                    raise SystemExit(f"stage {stage}: the launch failed:\n{done.stderr[-3000:]}")
                launch = summarize(json.loads(result.read_text()), args.warmup, tokens_per_step)
            launches.append(launch)
            print(f"stage {stage} launch {repeat + 1}/{args.repeats}: ours {launch['ours_tokens_per_s']:,.0f} tok/s, "
                  f"deepspeed {launch['deepspeed_tokens_per_s']:,.0f} tok/s, paired ratio (median over "
                  f"{args.steps} step pairs) {launch['paired_ratio']:.3f}", flush=True)
        ratio = statistics.median(launch["paired_ratio"] for launch in launches)
        print(f"stage {stage}: paired ratio ours/DeepSpeed {ratio:.3f} (median over launches)", flush=True)
        stages[str(stage)] = {"paired_ratio": ratio, "launches": launches}
    print(json.dumps({"stages": stages, "deepspeed_version": version, "torch": torch.__version__,
                      "settings": {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                                   "nproc": args.nproc, "tokens_per_step": tokens_per_step,
                                   "overrides": list(args.overrides)}}), flush=True)


if __name__ == "__main__":
    main()
