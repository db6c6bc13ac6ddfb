"""Throughput and memory monitors: what a run achieves, logged to every configured logger.

The loop itself logs the figures every run needs (train_loss, lr, grad_norm, tokens, tokens_per_s and
mfu, also in summary.json, with or without callbacks); the monitors add what explains them, without
logging any of those again:

- `ThroughputMonitor`: samples/s and achieved model FLOP/s over exactly the loop's logging interval
  (the same training time as the loop's tokens_per_s and mfu: `trainer.train_time_s` read at logged
  steps, so `flops_per_s / (peak x world) == mfu`), the mean step-time breakdown of the interval (data,
  forward/backward, optimizer from `trainer.step_timings`) and, where a profiler can see it, the time
  the step had collectives in flight.
- `MemoryMonitor`: peak memory of every rank (all ranks take part in one gather per logged step).

Both log on the loop's logged steps, through `trainer.log`, so every logger receives them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from trainer.callback import Callback
from trainer.hardware import peak_memory_bytes

if TYPE_CHECKING:
    from lightning.fabric.utilities.throughput import Throughput

    from trainer.loop import Trainer

log = logging.getLogger("trainer")
MIB = 2**20
# Phases of trainer.step_timings, in step order.
PHASES = ("data_s", "forward_backward_s", "optimizer_s")


def is_logged_step(trainer: "Trainer") -> bool:
    """True in on_train_batch_end when the loop has just logged this step's training metrics."""
    return trainer.logged_metrics.get("step") == trainer.step and "train_loss" in trainer.logged_metrics


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: wall time during which at least one was open.

    Collectives overlap each other (DDP buckets, several gloo threads), so their durations cannot
    simply be added.
    """
    total, open_start, open_end = 0.0, None, None
    for start, end in sorted(intervals):
        if open_end is None or start > open_end:
            if open_end is not None:
                total += open_end - open_start  # type: ignore[operator]
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None:
        total += open_end - open_start  # type: ignore[operator]
    return total


def communication_intervals(events: Any) -> list[tuple[float, float]]:
    """[start, end] seconds of the collectives in a profiler's events.

    On CPU the gloo backend records each collective it executes (`gloo:all_reduce`, ...) in its worker
    threads, from launch to completion (waiting for the peers included). On CUDA the NCCL kernels are
    the device-side record; their CPU-side `nccl:*` records only cover the launch and are ignored.
    """
    device_side = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and "nccl" in e.name.lower()]
    chosen = device_side or [e for e in events if e.name.startswith("gloo:")]
    return [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in chosen]


@dataclass
class ThroughputMonitorConfig:
    """Samples/s, model FLOP/s and the step-time breakdown of each logging interval (`callbacks.throughput`)."""

    _target_: str = "trainer.plugins.callbacks.ThroughputMonitor"
    # Profile one step in every N with torch.profiler to measure communication (`comm_s`: wall time of
    # that step, its logging included, with at least one collective in flight on rank 0; it overlaps
    # forward/backward). The profiled step runs slower, which the interval's tokens/s includes: 0 (the
    # default) never profiles.
    comm_every: int = 0


class ThroughputMonitor(Callback):
    """Logs, at each logged step, over the interval since the previous one:

    - `samples_per_s`, `flops_per_s`: sequences and model FLOPs (Narayanan et al. 2021, the same
      `flops_per_token` as the loop's mfu) per second of training time over all ranks, computed with
      Lightning's `Throughput` with the whole job as one device whose peak is `peak_flops x world`;
    - `data_s`, `forward_backward_s`, `optimizer_s`: mean seconds per step of each phase (host-side: on
      CUDA they show launch time; the interval's time per step, which also holds the callbacks and the
      wait for the device, is `tokens_per_step / tokens_per_s`);
    - `comm_s` on the profiled steps when `comm_every > 0` (see ThroughputMonitorConfig).

    tokens/s and MFU are the loop's (`tokens_per_s`, `mfu`): logged once, by the loop.
    """

    def __init__(self, comm_every: int = 0) -> None:
        if comm_every < 0:
            raise ValueError(f"comm_every must be >= 0 (0: never profile), got {comm_every}")
        self.comm_every = comm_every
        self._throughput: Throughput | None = None
        self._mark_at = (0, 0.0, 0)  # step, train time and tokens of the last mark
        self._phase_sums = dict.fromkeys(PHASES, 0.0)
        self._steps = 0
        self._profiler: Any = None
        self._comm_s: float | None = None

    @staticmethod
    def check_config(node: Any) -> None:
        if int(node.get("comm_every", 0)) < 0:
            raise ValueError(f"comm_every must be >= 0 (0: never profile), got {node.comm_every}")

    def _start_interval(self, trainer: "Trainer") -> None:
        # Imported here, not at the top: importing lightning costs seconds per process (see
        # trainer.run.seed_everything), paid only by runs that monitor throughput, on the rank that logs.
        from lightning.fabric.utilities.throughput import Throughput

        # A window of two marks: the previous logged step and this one, i.e. exactly the loop's interval.
        self._throughput = Throughput(available_flops=trainer.peak_flops * trainer.strategy.world_size,
                                      world_size=1, window_size=2)
        self._mark(trainer, flops=0)

    def _mark(self, trainer: "Trainer", flops: float) -> None:
        assert self._throughput is not None
        self._throughput.update(time=trainer.train_time_s, batches=trainer.step,
                                samples=trainer.tokens_seen // trainer.config.seq_len, lengths=trainer.tokens_seen,
                                flops=flops)
        self._mark_at = (trainer.step, trainer.train_time_s, trainer.tokens_seen)

    def _rates(self, trainer: "Trainer") -> dict[str, float] | None:
        """samples/s and FLOP/s since the last mark; None when the trainer went back to an earlier step
        since then (a rollback restored a checkpoint), which starts a new interval instead."""
        step, train_time, tokens = self._mark_at
        if trainer.step <= step or trainer.train_time_s <= train_time:
            self._start_interval(trainer)
            return None
        self._mark(trainer, flops=(trainer.tokens_seen - tokens) * trainer.flops_per_token)
        assert self._throughput is not None
        rates = self._throughput.compute()
        return {"samples_per_s": rates["device/samples_per_sec"], "flops_per_s": rates["device/flops_per_sec"]}

    def on_fit_start(self, trainer: "Trainer") -> None:
        if trainer.is_global_zero:  # the rates are logged by rank 0 alone
            self._start_interval(trainer)
        self._phase_sums = dict.fromkeys(PHASES, 0.0)
        self._steps = 0

    def _profile_this_step(self, trainer: "Trainer") -> bool:
        return self.comm_every > 0 and trainer.is_global_zero and (trainer.step + 1) % self.comm_every == 0

    def on_train_batch_start(self, trainer: "Trainer", batch: Sequence[Any]) -> None:
        if not self._profile_this_step(trainer):
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if trainer.strategy.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def on_train_batch_end(self, trainer: "Trainer", outputs: dict[str, Any]) -> None:
        if self._profiler is not None:
            if trainer.strategy.device.type == "cuda":
                torch.cuda.synchronize(trainer.strategy.device)
            self._profiler.stop()
            self._comm_s = busy_seconds(communication_intervals(self._profiler.events()))
            self._profiler = None
        for phase in PHASES:
            self._phase_sums[phase] += trainer.step_timings.get(phase, 0.0)
        self._steps += 1
        if not trainer.is_global_zero or not is_logged_step(trainer):
            return
        metrics = {phase: total / self._steps for phase, total in self._phase_sums.items()}
        metrics.update(self._rates(trainer) or {})
        if self._comm_s is not None:
            metrics["comm_s"] = self._comm_s
            self._comm_s = None
        trainer.log(metrics)
        self._phase_sums = dict.fromkeys(PHASES, 0.0)
        self._steps = 0

    def on_exception(self, trainer: "Trainer", exception: BaseException) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


@dataclass
class MemoryMonitorConfig:
    """Peak memory of every rank at each logged step (`callbacks.memory`)."""

    _target_: str = "trainer.plugins.callbacks.MemoryMonitor"


class MemoryMonitor(Callback):
    """Logs `peak_memory_mib/rank{R}` for every rank and `peak_memory_mib/max` at each logged step.

    The figure is `trainer.hardware.peak_memory_bytes`: the peak allocated accelerator memory on CUDA,
    the process's peak resident set size on CPU (both since the process started, as summary.json's
    `peak_memory_bytes_per_rank`). Every rank joins one object gather per logged step.
    """

    def on_train_batch_end(self, trainer: "Trainer", outputs: dict[str, Any]) -> None:
        # The loop logs the same steps on every rank, so every rank reaches the gather.
        if not is_logged_step(trainer):
            return
        peaks = trainer.strategy.all_gather_object(peak_memory_bytes(trainer.strategy.device))
        metrics = {f"peak_memory_mib/rank{rank}": peak / MIB for rank, peak in enumerate(peaks)}
        metrics["peak_memory_mib/max"] = max(peaks) / MIB
        trainer.log(metrics)
