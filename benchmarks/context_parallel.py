"""Context parallelism on gloo processes: activation memory per rank and the speed of the two methods.

1. Activation bytes one rank saves for the backward (SavedActivationMeter: what autograd keeps, the model's
   weights excluded) for one micro-batch of a long sequence, at cp = 1, 2 and 4 and for both methods, as a
   ratio to cp = 1 (ideal: 1/cp), with the planner's estimate (`estimate_activations`) beside each.
2. Forward + backward tokens/s of ring and all_to_all attention at cp = 2 and 4 (the same model and
   sequence; repeats alternate the methods A B B A), with the planner's estimate of the same work
   (compute + context-parallel traffic of one micro-batch, hardware=cpu) beside each.

    python benchmarks/context_parallel.py [--seq 4096] [--repeats 4]

Runs itself under torchrun with 4 processes (1 thread each; on a 2-core machine cp=4 shares the cores, so
compare methods within one cp, not cp against cp). The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import compose  # noqa: E402
from trainer.loss import cross_entropy_loss  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.models.context_parallel import ContextParallel, enable_context_parallel  # noqa: E402
from trainer.planner.activations import estimate_activations  # noqa: E402
from trainer.planner.layout import layout_from_config, model_config  # noqa: E402
from trainer.planner.params import inventory  # noqa: E402
from trainer.plugins.activation_checkpointing.accounting import SavedActivationMeter  # noqa: E402

MODEL = ["model=tiny", "model.dim=256", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4",
         "model.ffn_hidden_dim=512"]


def config(cp: int, method: str, seq: int) -> object:
    strategy = ["strategy=ddp", f"cp={cp}", f"trainer.devices={cp}"] if cp > 1 else []
    return compose([*MODEL, *strategy, f"cp_method={method}", f"trainer.seq_len={seq}", f"model.max_seq_len={seq}",
                    "trainer.micro_batch_size=1", "trainer.global_batch_size=1", "hardware=cpu"])


def groups(world: int, cp: int) -> list[list[int]]:
    return [list(range(start, start + cp)) for start in range(0, world, cp)]


def context(cp: int, method: str) -> ContextParallel | None:
    """This rank's cp group of size `cp` (consecutive ranks), or None for cp = 1. Every rank creates every
    group (new_group is collective)."""
    if cp == 1:
        return None
    mine = None
    for ranks in groups(dist.get_world_size(), cp):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = ContextParallel(group, ranks.index(dist.get_rank()), cp, method)
    return mine


def model_and_batch(cfg, ctx: ContextParallel | None, seq: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(model_config(cfg))
    enable_context_parallel(model, ctx)
    tokens = torch.randint(0, 256, (1, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if ctx is not None:
        inputs, targets = ctx.shard(inputs), ctx.shard(targets)
    return model, inputs, targets


def measure_activations(cp: int, seq: int, method: str = "ring") -> dict[str, float]:
    cfg = config(cp, method, seq)
    ctx = context(cp, method)
    result: dict[str, float] = {}
    if cp == 1 and dist.get_rank() != 0:
        return result
    model, inputs, targets = model_and_batch(cfg, ctx, seq)
    meter = SavedActivationMeter([model])
    with meter:
        loss = cross_entropy_loss(model(inputs), targets)
    loss.backward()
    estimate = estimate_activations(inventory(model_config(cfg)), layout_from_config(cfg), 0, "cpu").device
    return {"measured_bytes": float(meter.bytes), "estimated_bytes": estimate}


def time_method(cp: int, method: str, seq: int, steps: int) -> float:
    """Seconds per forward + backward of one sequence (the slowest rank of the group)."""
    ctx = context(cp, method)
    model, inputs, targets = model_and_batch(config(cp, method, seq), ctx, seq)
    for step in range(steps + 1):
        if step == 1:
            dist.barrier()
            start = time.perf_counter()
        cross_entropy_loss(model(inputs), targets).backward()
    elapsed = torch.tensor((time.perf_counter() - start) / steps)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def planned_seconds(cp: int, method: str, seq: int) -> float:
    """The planner's time for the same forward + backward: compute (model FLOPs at the cpu hardware's peak x
    matmul efficiency) plus the context-parallel traffic, for one micro-batch."""
    from trainer.planner import plan

    cfg = config(cp, method, seq)
    cfg.mode = "plan"
    result = plan(cfg, exact=False, search=False)
    cp_time = sum(c["time_s"] for c in result.communication if c["dimension"] == "cp")
    return result.details["time"]["compute_s"] + cp_time


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out: dict[str, object] = {"seq_len": args.seq, "activations": {}, "speed": {}}
    for cp, method in ((1, "ring"), (2, "ring"), (4, "ring"), (2, "all_to_all"), (4, "all_to_all")):
        row = measure_activations(cp, args.seq, method)
        if rank == 0:
            out["activations"][f"{cp} {method}" if cp > 1 else "1"] = row  # type: ignore[index]
    for cp in (2, 4):
        times: dict[str, list[float]] = {"ring": [], "all_to_all": []}
        order = ["ring", "all_to_all", "all_to_all", "ring"]  # A B B A: drifts of a shared machine cancel
        for repeat in range(args.repeats):
            method = order[repeat % 4]
            times[method].append(time_method(cp, method, args.seq, args.steps))
        if rank == 0:
            medians = {method: sorted(values)[len(values) // 2] for method, values in times.items() if values}
            out["speed"][str(cp)] = {  # type: ignore[index]
                method: {"seconds": seconds, "tokens_per_s": args.seq / seconds,
                         "planned_tokens_per_s": args.seq / planned_seconds(cp, method, args.seq)}
                for method, seconds in medians.items()}
    if rank == 0:
        report(out)
    dist.destroy_process_group()


def report(out: dict) -> None:
    base = out["activations"]["1"]["measured_bytes"]
    print(f"activations per rank, one sequence of {out['seq_len']} tokens")
    print(f"{'cp method':<14} {'measured MB':>12} {'ratio to cp=1':>14} {'1/cp':>6} {'planner MB':>11} "
          f"{'planner/measured':>17}")
    for key, row in out["activations"].items():
        cp = int(key.split()[0])
        print(f"{key:<14} {row['measured_bytes'] / 1e6:12.2f} {row['measured_bytes'] / base:14.3f} {1 / cp:6.3f} "
              f"{row['estimated_bytes'] / 1e6:11.2f} {row['estimated_bytes'] / row['measured_bytes']:17.3f}")
    print("\nforward + backward of one sequence (median of the repeats)")
    print(f"{'cp':>3} {'method':<11} {'tokens/s':>9} {'planner tokens/s':>17}")
    for cp, methods in out["speed"].items():
        for method, row in methods.items():
            print(f"{cp:>3} {method:<11} {row['tokens_per_s']:9.0f} {row['planned_tokens_per_s']:17.0f}")
        if len(methods) == 2:
            ratio = methods["all_to_all"]["tokens_per_s"] / methods["ring"]["tokens_per_s"]
            print(f"    all_to_all / ring tokens/s at cp={cp}: {ratio:.3f}")
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", __file__,
               "--worker", f"--seq={args.seq}", f"--repeats={args.repeats}", f"--steps={args.steps}"]
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
