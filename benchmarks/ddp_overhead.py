"""What does `strategy=ddp` cost over a hand-written torch DistributedDataParallel script?

Both sides train the same model (the default `tiny` config, or whatever the trailing Hydra overrides
make of it) in 2 gloo processes on CPU, on the same batches, with the same optimizer, parameter groups,
LR schedule, gradient accumulation and clipping:

- trainer:   `build_trainer(compose(overrides + ["strategy=ddp", "trainer.devices=2", ...]))`, `.fit()`,
             timed by a callback appended to `trainer.callbacks`;
- reference: the loop a researcher writes by hand: `torch.nn.parallel.DistributedDataParallel` with
             torch's defaults, `no_sync()` on every micro-batch but the last of a step, each micro-batch
             loss divided by the number of micro-batches, `clip_grad_norm_`, AdamW with no weight decay
             for tensors with ndim < 2 and embedding tables, warmup + cosine `LambdaLR`, and the loss
             all-reduced and read on the trainer's logging steps. Each rank reads its slice of every
             global batch from `trainer.run.build_data(cfg, vocab, dp_rank, dp_size)`, exactly as the
             trainer's ranks do.

Started plainly, the script re-launches itself under
`python -m torch.distributed.run --standalone --nproc-per-node 2 ... --worker` with OMP_NUM_THREADS=1.
The workers join one gloo process group (the trainer finds it and reuses it, as in
tests/distributed_harness.py) and alternate trainer / reference runs `--repeats` times so that drifts in
machine speed hit both alike. Each run times its steps after `--warmup` steps; a run's time is the
slowest rank's. Reported (by rank 0): median global tokens/s (all ranks) of each side, the ratio
trainer / reference (acceptance target >= 0.95; reported, never asserted), MFU of each against the
measured matmul peak of one process (`trainer.hardware.measure_matmul_flops`) times the world size, the
final training loss of each side (a check that both did the same work), and the settings.

    python benchmarks/ddp_overhead.py          # tiny model, 3 x (23 + 23) steps: ~4 min on 2 cores
    python benchmarks/ddp_overhead.py --steps 3 --warmup 1 --repeats 1 \\
        model.dim=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.ffn_hidden_dim=128 \\
        trainer.seq_len=64 data.max_bytes=1000000    # smoke test, ~30 s

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import StepClock  # noqa: E402

from trainer.config import compose, total_steps  # noqa: E402
from trainer.hardware import measure_matmul_flops  # noqa: E402
from trainer.models import build_meta_model, build_model  # noqa: E402
from trainer.models.common import CausalLM  # noqa: E402
from trainer.run import build_data, build_trainer  # noqa: E402

TARGET_RATIO = 0.95




# ---- shared by both sides -----------------------------------------------------------------------------
def measured_seconds(times: list[float], warmup: int) -> tuple[float, int]:
    """Seconds and number of steps after the first `warmup` steps."""
    measured = times[warmup:]
    return measured[-1] - measured[0], len(measured) - 1


def slowest_rank_tokens_per_s(times: list[float], warmup: int, tokens_per_step: int) -> float:
    """Global tokens/s of a run, timed by its slowest rank.

    Ranks meet at every gradient all-reduce, so their clocks differ by little; taking the slowest keeps
    the figure honest if one rank lags (e.g. rank 0 writing metrics.csv).
    """
    seconds, steps = measured_seconds(times, warmup)
    per_rank: list[tuple[float, int]] = [(0.0, 0)] * dist.get_world_size()
    dist.all_gather_object(per_rank, (seconds, steps))
    slowest = max(s for s, _ in per_rank)
    return steps * tokens_per_step / slowest


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay the matrices of linear maps only: not vectors (norm gains, biases) nor embedding tables."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay = [], []
    for param in model.parameters():
        if param.ndim < 2 or id(param) in embedding_params:
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(steps: int, warmup_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then half a cosine down to min_ratio at the last step."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps + 1) / max(1, steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(progress * math.pi))

    return multiplier


@contextlib.contextmanager
def shared_run_dir() -> Any:
    """One temporary run directory for all ranks (rank 0 creates and removes it).

    Each rank making its own would leave the trainer to pick rank 0's anyway (agree_on_run_dir) and
    delete the others' under their TemporaryDirectory.
    """
    path = [tempfile.mkdtemp(prefix="ddp_overhead_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(path, src=0)
    try:
        yield Path(path[0])
    finally:
        dist.barrier()  # nobody may still be using it
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


# ---- the two sides --------------------------------------------------------------------------------------
def run_trainer(overrides: list[str], warmup: int, tokens_per_step: int) -> tuple[float, float]:
    """(global tokens/s, final train loss) of one `strategy=ddp` run."""
    clock = StepClock()
    with shared_run_dir() as run_dir:
        trainer = build_trainer(compose(overrides), run_dir)
        trainer.callbacks.append(clock)
        trainer.fit()
        loss = trainer.last_train_loss  # the mean over ranks of the last step's loss
        del trainer  # release the DDP reducer and its buckets before the reference runs
    return slowest_rank_tokens_per_s(clock.times, warmup, tokens_per_step), loss


def run_reference(cfg: DictConfig, warmup: int, tokens_per_step: int) -> tuple[float, float]:
    """(global tokens/s, final train loss) of the hand-written DDP loop."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model)
    if cfg.trainer.compile:  # per block, as the trainer does, so both compile the same graphs
        for block in cast(nn.ModuleDict, model.layers).values():
            block.compile()
    ddp = DistributedDataParallel(model)  # torch's defaults: 25 MB buckets, rank 0's weights broadcast
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(weight_decay_groups(model, opt.weight_decay), lr=opt.lr,
                                  betas=tuple(opt.betas), eps=opt.eps)
    steps = total_steps(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(steps, cfg.lr_schedule.warmup_steps, cfg.lr_schedule.min_ratio))
    loader, _ = build_data(cfg, cfg.model.vocab_size, dp_rank=rank, dp_size=world)
    log_every, grad_clip = cfg.trainer.log_every, cfg.trainer.grad_clip

    final_loss = math.nan
    times = [time.perf_counter()]
    for step in range(1, steps + 1):
        microbatches = next(loader)
        last = len(microbatches) - 1
        total = torch.zeros(())
        for index, (x, y) in enumerate(microbatches):
            # gradients are all-reduced only with the last micro-batch's backward
            with ddp.no_sync() if index < last else contextlib.nullcontext():
                logits = ddp(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(microbatches)
                loss.backward()
            total += loss.detach()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps:  # the trainer's logging steps: same syncs
            dist.all_reduce(total)
            final_loss = total.item() / world
        times.append(time.perf_counter())
    return slowest_rank_tokens_per_s(times, warmup, tokens_per_step), final_loss


# ---- processes ------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="steps run before the clock starts")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side (median)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (data-parallel ranks)")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="sequences per forward; the default 4 with 16-sequence global batches on 2 "
                             "ranks gives 2 micro-batches per step, so no_sync is exercised")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block on both sides")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to both sides (model.dim=64 ...)")
    return parser.parse_intermixed_args(argv)  # overrides may come before or after the flags


def launch(argv: list[str], nproc: int) -> int:
    """Run this script again as `nproc` torchrun workers; their output is ours."""
    # One intra-op thread per process: 2 processes share 2 cores (the trainer picks the same).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), "--worker", *argv]
    return subprocess.run(command, env=env).returncode


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # once; every trainer of this process joins it
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    threads = max(1, (os.cpu_count() or 1) // local_world)  # what DistributedStrategy picks by itself
    torch.set_num_threads(threads)

    n = args.steps + args.warmup
    common = list(args.overrides) + [
        f"trainer.max_steps={n}", "trainer.val_every=0", "trainer.val_batches=1", "callbacks=none",
        f"trainer.micro_batch_size={args.micro_batch_size}", f"trainer.compile={args.compile}",
        f"trainer.num_threads={threads}", "lr_schedule.warmup_steps=1",
    ]
    trainer_overrides = common + ["strategy=ddp", f"trainer.devices={world}"]
    cfg = compose(common)  # the reference's view of the same run (single strategy: no launcher checks)
    tokens_per_step = cfg.trainer.global_batch_size * cfg.trainer.seq_len
    accumulation = cfg.trainer.global_batch_size // (cfg.trainer.micro_batch_size * world)
    # Measured on every rank at once, as the trainer does, so each sees the cores shared as in training;
    # cached, so the trainer's own MFU uses the same figure.
    peak = measure_matmul_flops("cpu", torch.float32)
    peak_per_rank: list[float] = [0.0] * world
    dist.all_gather_object(peak_per_rank, peak)
    meta = cast(CausalLM, build_meta_model(cfg.model))  # shapes only: no memory
    flops_per_token = meta.flops_per_token(cfg.trainer.seq_len)

    ours: list[float] = []
    reference: list[float] = []
    losses: dict[str, float] = {}
    for repeat in range(args.repeats):  # alternate, so drifts in machine speed hit both sides alike
        tps, losses["trainer"] = run_trainer(trainer_overrides, args.warmup, tokens_per_step)
        ours.append(tps)
        tps, losses["reference"] = run_reference(cfg, args.warmup, tokens_per_step)
        reference.append(tps)
        if rank == 0:
            print(f"run {repeat + 1}/{args.repeats}: trainer {ours[-1]:,.0f} tok/s, "
                  f"reference {reference[-1]:,.0f} tok/s, ratio {ours[-1] / reference[-1]:.3f}", flush=True)

    total_peak = peak_per_rank[0] * world  # as Trainer.throughput: one process's peak x world size
    ours_median, ref_median = statistics.median(ours), statistics.median(reference)
    ratio = ours_median / ref_median
    ours_mfu, ref_mfu = ours_median * flops_per_token / total_peak, ref_median * flops_per_token / total_peak
    results: dict[str, Any] = {
        "trainer_tokens_per_s": ours_median,
        "reference_tokens_per_s": ref_median,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "trainer_mfu": ours_mfu,
        "reference_mfu": ref_mfu,
        "trainer_runs": ours,
        "reference_runs": reference,
        "trainer_final_train_loss": losses["trainer"],
        "reference_final_train_loss": losses["reference"],
        "peak_matmul_flops_per_rank": peak_per_rank,
        "peak_matmul_flops_total": total_peak,
        "flops_per_token": flops_per_token,
        "settings": {
            "world_size": world, "threads_per_rank": threads, "model": cfg.model.name,
            "num_params": meta.num_params(), "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "seq_len": cfg.trainer.seq_len,
            "global_batch_size": cfg.trainer.global_batch_size,
            "micro_batch_size": cfg.trainer.micro_batch_size, "grad_accumulation": accumulation,
            "tokens_per_step": tokens_per_step, "grad_clip": cfg.trainer.grad_clip,
            "compile": args.compile, "overrides": list(args.overrides), "torch": torch.__version__,
        },
    }
    if rank == 0:
        print(f"trainer {ours_median:,.0f} tok/s, reference {ref_median:,.0f} tok/s, ratio {ratio:.3f} "
              f"(target >= {TARGET_RATIO}), MFU {100 * ours_mfu:.1f}% vs {100 * ref_mfu:.1f}%", flush=True)
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        worker(args)
    else:
        sys.exit(launch(argv, args.nproc))


if __name__ == "__main__":
    main()
