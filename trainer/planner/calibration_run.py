"""The measuring half of `mode=plan plan.calibrate=true`: what every worker of the configuration does.

Each worker trains the configuration for `plan.calibrate_warmup` + `plan.calibrate_steps` steps, exactly
as `mode=train` would (trainer.run.build_trainer, the same strategy, callbacks and threads), with one
addition: a `StepProbe` callback that measures the peak of live tensor bytes during the last warm-up step
(`trainer.memory.TensorPeakMeter`), times each step after the warm-up and measures the compute figures
between the timed steps. Then, with the
process groups of the run still up, every worker measures the hardware the planner's time model needs,
all workers at once (as in training, where they share the machine; the compute dtype's figures also after
every timed step, outside its time, and their median counts: on a shared machine other jobs' load comes
and goes, and figures taken between the steps saw the load the steps ran in):
- matmul FLOP/s of one process in fp32, bf16 and fp16 (`trainer.hardware.matmul_flops`, its thread count),
  and in the compute dtype at the sizes of the configuration's own matmuls on this rank, forward and
  backward (`trainer.hardware.shapes_matmul_flops` over `trainer.planner.timing.matmul_shapes`), and of
  its attention core in SDPA's fused kernel (`trainer.hardware.attention_flops`);
- memory bandwidth of one process (`trainer.hardware.memory_bandwidth`);
- per process group of every parallel dimension in use (`ParallelDims.named_groups`, as `mode=check`),
  all-reduce, all-gather, reduce-scatter and point-to-point of a small payload (latency) and of
  `plan.calibrate_message_mb` MiB (bandwidth), with `trainer.commcheck.time_collective`;
- the pipeline runtime's overhead per compute action (trainer/planner/pipeline_overhead.py: a
  near-zero-compute pipeline over pairs of ranks), with 2 or more processes, whatever the layout.
Rank 0 writes every rank's figures to `MEASURED_FILE` in the run directory for trainer/planner/calibrate.py.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from trainer.callback import Callback
from trainer.commcheck import LATENCY_ITERS, OPS, time_collective
from trainer.hang import HangWatchdog
from trainer.hardware import (attention_flops, matmul_flops, memory_bandwidth, peak_memory_bytes,
                              shapes_matmul_flops)
from trainer.interfaces.strategy import Strategy
from trainer.memory import TensorPeakMeter
from trainer.planner.hardware import DTYPE_NAMES
from trainer.planner.layout import layout_from_config, model_config
from trainer.planner.memory import RankCoords
from trainer.planner.params import inventory
from trainer.planner.pipeline_overhead import measure_pipeline_overhead
from trainer.planner.timing import attention_shape, causal_block_skipping, matmul_shapes
from trainer.run import build_trainer

MEASURED_FILE = "calibration_measured.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BANDWIDTH_ITERS = 3
# Rounds of ring hops one collective of each kind takes on n ranks (the planner's latency terms).
HOPS = {"all-reduce": lambda n: 2 * (n - 1), "all-gather": lambda n: n - 1, "reduce-scatter": lambda n: n - 1,
        "point-to-point": lambda n: 1}
# Bytes one rank sends per payload byte (ring algorithms; trainer/planner/communication.py).
SENT = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
        "reduce-scatter": lambda n: (n - 1) / n, "point-to-point": lambda n: 1.0}


class StepProbe(Callback):
    """Wall time of each step after the warm-up (from the end of one step to the end of the next, so
    loading its data and the callbacks count), the peak tensor memory of the last warm-up step (the second
    step or later: the first creates the optimizer states), and after each timed step, outside its time, a
    compute measurement in the run's compute dtype (`sizes`: `model_sizes`): on a shared machine other
    jobs' load comes and goes, and hardware figures taken between the timed steps saw the load they ran in."""

    def __init__(self, warmup: int, sizes: dict[str, Any]) -> None:
        self.warmup = warmup
        self.sizes = sizes
        self.meter = TensorPeakMeter()
        self.samples: list[dict[str, Any]] = []
        self.step_times: list[float] = []
        self.phases: list[dict[str, float]] = []  # the loop's data / forward-backward / optimizer times per step
        self._last_end = 0.0

    def on_train_batch_start(self, trainer: Any, batch: Any) -> None:
        if trainer.step + 1 == self.warmup:
            self.meter.start()

    def on_train_batch_end(self, trainer: Any, outputs: dict[str, Any]) -> None:
        now = time.perf_counter()
        if trainer.step > self.warmup:
            self.step_times.append(now - self._last_end)
            self.phases.append(dict(trainer.step_timings))
        if self.meter.running:
            self.meter.stop()  # the profiler's cost stays out of the timed steps
        if trainer.step >= self.warmup:
            dtype = trainer.strategy.precision.compute_dtype
            self.samples.append(measure_compute(trainer.strategy, self.sizes, {DTYPE_NAMES[dtype]: dtype}))
        self._last_end = time.perf_counter()


def _busy(strategy: Strategy, measure: Any) -> Any:
    """`measure()` on every rank at once (a barrier first), as training loads the machine."""
    strategy.barrier()
    return measure()


def measure_links(strategy: Strategy, message_mb: float) -> list[dict[str, Any]]:
    """Latency (s per hop) and bandwidth (bytes/s one rank sends) of each op on each distinct group of the
    run's mesh (every rank takes part in the same order; a flattened group with the ranks of one already
    measured is that group again)."""
    dims = strategy.parallel_dims
    if dims is None or not dist.is_initialized():
        return []
    rows, seen = [], {}
    numel = max(1, int(message_mb * 2**20) // 4)
    for name, mesh in dims.named_groups():
        group = mesh.get_group()
        n = dist.get_world_size(group)
        ranks = tuple(dist.get_process_group_ranks(group))
        if n < 2:
            continue
        if ranks in seen:
            rows += [{**row, "group": name} for row in seen[ranks]]
            continue
        measured = []
        for op in OPS:
            small = time_collective(op, 2, group, LATENCY_ITERS, strategy.device)
            large = time_collective(op, numel, group, BANDWIDTH_ITERS, strategy.device)
            payload = max(n, numel - numel % n) * 4
            latency = small / HOPS[op](n)
            # the latency part of the large message is the small message's time
            bandwidth = SENT[op](n) * payload / max(large - small, 1e-9)
            measured.append({"group": name, "op": op, "size": n, "ranks": list(ranks), "latency_s": latency,
                             "bandwidth_bps": bandwidth, "small_s": small, "large_s": large,
                             "payload_bytes": payload})
        seen[ranks] = measured
        rows += measured
    return rows


def model_sizes(cfg: DictConfig, rank: int, device_type: str) -> dict[str, Any]:
    """The sizes of the configuration's own compute on `rank`: its matmuls
    (trainer.planner.timing.matmul_shapes) and, when it runs in SDPA's fused kernel, its attention core
    (`attention_shape`, causal or not; None on the math path, which the matmul figures cover)."""
    layout = layout_from_config(cfg)
    inv = inventory(model_config(cfg))
    fused = inv.attn_impl != "materialized" and not (inv.dropout > 0 and device_type == "cpu")
    return {"matmuls": matmul_shapes(inv, layout, RankCoords.of(rank, layout)),
            "attention": attention_shape(inv, layout) if fused else None,
            "causal": causal_block_skipping(inv, layout, device_type)}


def measure_compute(strategy: Strategy, sizes: dict[str, Any], dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """This rank's matmul FLOP/s in `dtypes` (square products, the peak), and in the compute dtype at the
    model's own matmul and attention sizes (`model_sizes`), measured with every rank busy."""
    device = strategy.device.type
    matmul = {name: _busy(strategy, lambda d=dtype: matmul_flops(device, d, min_seconds=0.02))
              for name, dtype in dtypes.items()}
    dtype = strategy.precision.compute_dtype
    model = _busy(strategy, lambda: shapes_matmul_flops(sizes["matmuls"], device, dtype))
    attention = None
    if sizes["attention"] is not None:
        attention = _busy(strategy, lambda: attention_flops(*sizes["attention"], causal=sizes["causal"],
                                                            device_type=device, dtype=dtype))
    return {"matmul_flops": matmul, "model_matmul_flops": model, "attention_flops": attention,
            "compute_dtype": DTYPE_NAMES[dtype]}


def median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Figure by figure, the median of compute measurements (None stays None)."""
    first = samples[0]
    out: dict[str, Any] = {"compute_dtype": first["compute_dtype"],
                           "matmul_flops": {k: statistics.median(s["matmul_flops"][k] for s in samples)
                                            for k in first["matmul_flops"]}}
    for key in ("model_matmul_flops", "attention_flops"):
        out[key] = None if first[key] is None else statistics.median(s[key] for s in samples)
    return out


def measure_hardware(strategy: Strategy, message_mb: float, sizes: dict[str, Any],
                     samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Every dtype's matmul peak, memory bandwidth and links, every rank busy; the compute dtype's figures
    are the median of the `samples` taken between the timed steps."""
    compute = measure_compute(strategy, sizes, DTYPES)
    if samples:
        between = median_of(samples)
        compute = {**compute, **{k: v for k, v in between.items() if k != "matmul_flops"},
                   "matmul_flops": {**compute["matmul_flops"], **between["matmul_flops"]}}
    bandwidth = _busy(strategy, lambda: memory_bandwidth(strategy.device.type))
    links = measure_links(strategy, message_mb)
    # whatever the configuration's own layout: strategy=auto ranks pipelined layouts on this profile too
    overhead = measure_pipeline_overhead(strategy.device) if dist.is_initialized() else None
    return {**compute, "memory_bandwidth_bps": bandwidth, "links": links, "threads": torch.get_num_threads(),
            "pipeline_overhead_s": overhead}


def calibration_worker(cfg: DictConfig, run_dir: Path) -> None:
    """Train the configuration for the calibration's steps on this process, measure, and (rank 0) write
    every rank's figures to `run_dir / MEASURED_FILE`. `cfg` is the run's config (mode=train)."""
    options = cfg.plan
    warmup, steps = int(options.calibrate_warmup), int(options.calibrate_steps)
    trainer = build_trainer(cfg, run_dir)
    sizes = model_sizes(cfg, trainer.strategy.rank, trainer.strategy.device.type)
    probe = StepProbe(warmup, sizes)
    # before the hang watchdog, which stays last (its step-end deadline starts after the other callbacks)
    watchdogs = sum(isinstance(c, HangWatchdog) for c in trainer.callbacks)
    trainer.callbacks.insert(len(trainer.callbacks) - watchdogs, probe)
    summary = trainer.fit()
    strategy = trainer.strategy
    peak_rss = peak_memory_bytes(strategy.device)  # the run's, before the measurements' own tensors
    hardware = measure_hardware(strategy, float(options.calibrate_message_mb), sizes, probe.samples)
    local = {"rank": strategy.rank, "step_times_s": probe.step_times, "phases_s": probe.phases,
             "peak_tensor_bytes": probe.meter.peak_bytes,
             "unseen_free_bytes": probe.meter.unseen_free_bytes, "peak_rss_bytes": peak_rss, **hardware}
    gathered = strategy.all_gather_object(local)
    if strategy.is_global_zero:
        record = {"warmup_steps": warmup, "steps": steps, "tokens_per_step": trainer.tokens_per_step,
                  "world_size": strategy.world_size, "device": strategy.device.type,
                  "state_bytes_per_rank": summary["state_bytes_per_rank"], "ranks": gathered}
        if "grad_sync" in cfg.strategy:  # what the run settled (grad_sync=auto), for the prediction
            record["grad_sync"] = [cfg.strategy.grad_sync, cfg.strategy.reshard_after_backward]
        (trainer.run_dir / MEASURED_FILE).write_text(json.dumps(record, indent=1) + "\n")
    # as trainer.run.train: the model goes before the process group (DDP's reducer holds the gloo group)
    del trainer
    gc.collect()
    strategy.teardown()


def step_time(record: dict[str, Any]) -> float:
    """The run's step time: per step the slowest rank's (the ranks wait for each other), then the median."""
    per_step = zip(*(rank["step_times_s"] for rank in record["ranks"]))
    return statistics.median(max(times) for times in per_step)
