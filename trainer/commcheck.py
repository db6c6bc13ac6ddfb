"""`python -m trainer mode=check ...`: bandwidth and latency of each parallel dimension's process group.

Started like a training run (the same processes, process group and `ParallelDims` mesh), it times, on
every group of every dimension in use (pp, dp_replicate, dp_shard, cp, tp and the flattened dp / dp_cp /
dp_shard_cp), all-reduces of 8 bytes (latency, microseconds per call) and of `check.size_mb` MiB
(bandwidth: algorithm GB/s = bytes / time, bus GB/s = 2 (n - 1) / n x that, the figure NCCL's tests print
and comparable across group sizes). All groups of one dimension are measured at once, as training uses
them; rank 0 prints one row per dimension with the slowest group's figures and its ranks, so a slow link
is found before a long job starts. Nothing is trained or written besides the log.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig

log = logging.getLogger("trainer")
LATENCY_ITERS = 20


# The collectives `time_collective` times, named as the planner names them (trainer/planner/communication.py).
OPS = ("all-reduce", "all-gather", "reduce-scatter", "point-to-point")


def _run(op: str, tensors: tuple[torch.Tensor, torch.Tensor], group: Any) -> None:
    """One `op` over `group`: `tensors` are (input, output) as `time_collective` made them."""
    source, target = tensors
    if op == "all-reduce":
        dist.all_reduce(source, group=group)
    elif op == "all-gather":
        dist.all_gather_single(target, source, group=group)
    elif op == "reduce-scatter":
        dist.reduce_scatter_single(target, source, group=group)
    else:  # point-to-point: every rank sends to the next in the group and receives from the previous (a ring)
        ranks = dist.get_process_group_ranks(group)
        index = ranks.index(dist.get_rank())
        ops = [dist.P2POp(dist.isend, source, ranks[(index + 1) % len(ranks)], group),
               dist.P2POp(dist.irecv, target, ranks[(index - 1) % len(ranks)], group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def time_collective(op: str, numel: int, group: Any, iters: int, device: torch.device) -> float:
    """Seconds per `op` (one of OPS) of a payload of `numel` fp32 elements over `group`, after one warm-up
    call: the whole tensor an all-reduce reduces, an all-gather gathers and a reduce-scatter scatters (each
    rank holding 1/n of it on the sharded side), and what each rank sends to the next in a point-to-point
    exchange. Every rank of the group must call it with the same arguments."""
    n = dist.get_world_size(group)
    numel = max(n, numel - numel % n)  # the sharded side splits evenly
    full = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // n, device=device)
    tensors = {"all-reduce": (full, full), "all-gather": (shard, full), "reduce-scatter": (full, shard),
               "point-to-point": (full, torch.empty_like(full))}[op]
    _run(op, tensors, group)
    dist.barrier(group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        _run(op, tensors, group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def measure(dims: Any, device: torch.device, size_mb: float, iters: int) -> list[dict[str, Any]]:
    """This rank's row per dimension: its group's ranks, latency (us) and bandwidth (GB/s)."""
    groups = [(name, mesh.get_group()) for name, mesh in dims.named_groups()]
    rows = []
    numel = max(1, int(size_mb * 2**20) // 4)
    for name, group in groups:
        size = dist.get_world_size(group)
        if size < 2:
            continue
        latency = time_collective("all-reduce", 2, group, LATENCY_ITERS, device)
        seconds = time_collective("all-reduce", numel, group, iters, device)
        algbw = numel * 4 / seconds / 1e9
        rows.append({"group": name, "size": size, "ranks": dist.get_process_group_ranks(group),
                     "latency_us": latency * 1e6, "algbw_gbs": algbw, "busbw_gbs": algbw * 2 * (size - 1) / size})
    return rows


def format_table(per_rank: list[list[dict[str, Any]]], size_mb: float) -> str:
    """One row per dimension: the slowest group (lowest bus bandwidth) and the worst latency."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for rows in per_rank:
        for row in rows:
            by_group.setdefault(row["group"], []).append(row)
    lines = [f"{'group':<12} {'size':>4} {'latency us':>11} {'GB/s (alg)':>11} {'GB/s (bus)':>11}  slowest group's ranks",
             "-" * 80]
    for name, rows in by_group.items():
        slowest = min(rows, key=lambda r: r["busbw_gbs"])
        latency = max(r["latency_us"] for r in rows)
        lines.append(f"{name:<12} {slowest['size']:>4} {latency:>11.1f} {slowest['algbw_gbs']:>11.3f} "
                     f"{slowest['busbw_gbs']:>11.3f}  {slowest['ranks']}")
    if not by_group:
        lines.append("(no parallel dimension of size > 1: nothing to measure)")
    lines.append(f"all-reduce of 8 B (latency) and {size_mb:g} MiB (bandwidth) on every group of each dimension "
                 "at once; the worst group is shown")
    return "\n".join(lines)


def check(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run the measurements on this process (a worker of the run's world) and print the table on rank 0."""
    from trainer.launch import agree_on_run_dir

    t = cfg.trainer
    strategy = instantiate(cfg.strategy)
    strategy.setup_environment(t.accelerator, t.num_threads, cfg.dp, cfg.tp, cfg.pp, cfg.cp, cfg.cp_method)
    agree_on_run_dir(strategy, run_dir)
    rows = measure(strategy.parallel_dims, strategy.device, float(cfg.check.size_mb), int(cfg.check.iters)) \
        if strategy.parallel_dims is not None else []
    gathered = strategy.all_gather_object(rows)
    table = format_table(gathered, float(cfg.check.size_mb))
    if strategy.is_global_zero:
        log.info(f"communication check: {strategy.world_size} processes, backend "
                 f"{dist.get_backend() if dist.is_initialized() else 'none'}\n{table}")
    strategy.teardown()
    return {"groups": gathered[0] if gathered else []}
