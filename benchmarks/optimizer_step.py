"""The optimizer step of each ZeRO partition: torch's AdamW implementations side by side, in one run.

ZeRO-1/2 (`ShardedOptimizerStates`) hand the optimizer a Shard(0) DTensor row view of every parameter
(about 60 for the default tiny model); DeepSpeed hands it one flat fp32 partition per parameter group. On
CPU, torch's AdamW with `fused` and `foreach` left unset steps tensor by tensor; `fused: null` in this
trainer's AdamW config now means torch's fused kernel wherever it runs (trainer/optim.py). This script
times `optimizer.step()` for each implementation (for-loop, foreach, fused) on each way of holding the
partition (the DTensor row views the trainer uses, their plain local tensors, one flat tensor as DeepSpeed
steps), on `--nproc` gloo processes (each steps its 1/nproc partition, as in a run), the implementations
alternating in ABBA order over `--repeats` rounds, and prints the median milliseconds per step and each
ratio against the trainer's old default (DTensor views, for-loop). It also times the collectives around the
step, each against a bare collective of the same bytes: ZeRO-1/2's all-gather that brings every rank the rows
the others updated (`_gather_updated_rows`; bare: `all_gather_into_tensor`) and ZeRO-2's reduce-scatter of
the accumulated gradients into each rank's rows (`reduce_scatter_gradients`; bare: `reduce_scatter_tensor`).
Last line: one JSON object.

    python benchmarks/optimizer_step.py                      # 2 processes x 1 thread, tiny model
    python benchmarks/optimizer_step.py --nproc 1 model=llama2_7b model.n_layers=2   # any model overrides
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
HOLDERS = ("dtensor_views", "local_tensors", "flat")
REFERENCE = ("dtensor_views", "for-loop")


def build_optimizers(overrides: list[str]) -> dict[tuple[str, str], tuple[torch.optim.Optimizer, list[torch.Tensor]]]:
    """Every (holder, implementation): an AdamW over this rank's partition of the model, gradients set."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.config import compose
    from trainer.models import build_meta_model
    from trainer.optim import param_groups
    from trainer.plugins.strategies.ddp import ShardedOptimizerStates

    cfg = compose(overrides)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    optimizers = {}
    for implementation, options in IMPLEMENTATIONS.items():
        model = build_meta_model(cfg.model)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        states = ShardedOptimizerStates(mesh, torch.device("cpu"))
        groups = [{**g, "params": [states._sharded_view(p) for p in g["params"]]}
                  for g in param_groups([model], float(cfg.optimizer.weight_decay))]
        views = [view for group in groups for view in group["params"]]
        locals_ = [torch.nn.Parameter(view.to_local().detach().clone()) for view in views]
        flat = [torch.nn.Parameter(torch.cat([t.detach().reshape(-1) for t in locals_]))]
        for holder, tensors in zip(HOLDERS, (views, locals_, flat)):
            for tensor in tensors:
                tensor.grad = torch.randn_like(tensor) if holder != "dtensor_views" else tensor.detach().clone().normal_()
            optimizer = torch.optim.AdamW(tensors, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **options)
            optimizers[(holder, implementation)] = (optimizer, tensors)
    return optimizers


def time_collectives(args: argparse.Namespace) -> dict[str, float]:
    """Median ms of ZeRO-1/2's all-gather of the updated rows and of ZeRO-2's reduce-scatter of the gradients
    into each rank's rows, each beside one bare collective of as many bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.config import compose
    from trainer.models import build_meta_model
    from trainer.optim import param_groups
    from trainer.plugins.strategies.ddp import ShardedGradients

    cfg = compose(args.overrides)
    model = build_meta_model(cfg.model)
    model.to_empty(device="cpu")
    states = ShardedGradients(init_device_mesh("cpu", (dist.get_world_size(),)), torch.device("cpu"))
    params = [param for group in param_groups([model], 0.0) for param in group["params"]]
    for param in params:
        states._sharded_view(param)
    grads = [torch.randn_like(param) for param in params]

    def reduce_scatter() -> None:
        for param, grad in zip(params, grads):  # it frees the whole gradients: hand them back (no copy)
            param.grad = grad
        states.reduce_scatter_gradients()

    numel = sum(view.to_local().numel() for _, view in states.optimizer_tensor_pairs())
    shard, whole = torch.empty(numel), torch.empty(numel * dist.get_world_size())
    runs: dict[str, Callable[[], Any]] = {
        "rows_all_gather": states._gather_updated_rows,
        "bare_all_gather": lambda: dist.all_gather_into_tensor(whole, shard),
        "gradient_reduce_scatter": reduce_scatter,
        "bare_reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, whole)}
    times: dict[str, list[float]] = {key: [] for key in runs}
    for round_ in range(args.repeats):
        for key in (list(runs) if round_ % 2 == 0 else list(runs)[::-1]):
            runs[key]()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                runs[key]()
            times[key].append((time.perf_counter() - start) / args.steps * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    gathers = time_collectives(args)
    optimizers = build_optimizers(args.overrides)
    keys = list(optimizers)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    for optimizer, _ in optimizers.values():  # the states' allocation and first-call costs
        for _ in range(args.warmup):
            optimizer.step()
    for round_ in range(args.repeats):
        for key in (keys if round_ % 2 == 0 else keys[::-1]):  # ABBA
            optimizer, _ = optimizers[key]
            dist.barrier()  # every rank steps at once, as in a run
            start = time.perf_counter()
            for _ in range(args.steps):
                optimizer.step()
            times[key].append((time.perf_counter() - start) / args.steps * 1e3)
    numel = sum(t.numel() for t in optimizers[("flat", "fused")][1])
    tensors = len(optimizers[REFERENCE][1])
    if dist.get_rank() == 0:
        medians = {key: statistics.median(values) for key, values in times.items()}
        reference = medians[REFERENCE]
        print(f"AdamW step of one rank's partition ({numel:,} elements, {tensors} tensors as views), "
              f"{dist.get_world_size()} processes x {args.threads} thread(s), median of {args.repeats} rounds "
              f"x {args.steps} steps")
        print(f"{'holder':<15} {'implementation':<15} {'ms/step':>8} {'vs views for-loop':>18}")
        for (holder, implementation), value in medians.items():
            print(f"{holder:<15} {implementation:<15} {value:8.2f} {reference / value:17.2f}x")
        print(f"all-gather of the updated rows {gathers['rows_all_gather']:.2f} ms, bare all-gather of the same "
              f"bytes {gathers['bare_all_gather']:.2f} ms")
        print(f"reduce-scatter of the gradients into each rank's rows (zero2) {gathers['gradient_reduce_scatter']:.2f} "
              f"ms, bare reduce-scatter of the same bytes {gathers['bare_reduce_scatter']:.2f} ms")
        print(json.dumps({"elements_per_rank": numel, "tensors": tensors, "world_size": dist.get_world_size(),
                          "collective_ms": gathers,
                          "ms_per_step": {f"{h}/{i}": v for (h, i), v in medians.items()},
                          "speedup_vs_views_for_loop": {f"{h}/{i}": reference / v for (h, i), v in medians.items()}}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="gloo processes (each steps its partition)")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timing")
    parser.add_argument("--repeats", type=int, default=6, help="ABBA rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the model (default: the tiny Llama)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", f"--threads={args.threads}", f"--steps={args.steps}",
               f"--repeats={args.repeats}", f"--warmup={args.warmup}", *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    raise SystemExit(subprocess.call(command, cwd=REPO, env=env))


if __name__ == "__main__":
    main()
