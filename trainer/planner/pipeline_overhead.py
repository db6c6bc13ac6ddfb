"""The pipeline runtime's own time per action, measured on this machine (`pipeline_action_overhead_us`).

torch's pipeline schedules do Python work around every compute action (a chunk's forward, full backward,
input- or weight-gradient pass): the runtime walks its action list, issues and waits on the batched
sends and receives (`_batch_p2p`, `_wait_batch_p2p`), hands a V's turn between a rank's two stages, keeps
its per-stage bookkeeping, and autograd's engine starts once per backward call. None of it is the
stage's compute, and no bubble formula counts it; on a CPU it is milliseconds per action, the same order
as a small model's chunk.

The probe (`probe_pipeline`) runs torch's ZBV schedule (`ScheduleZBVZeroBubble`, the `_PipelineScheduleRuntime`
that interleaved_1f1b, zero_bubble, zbv and dualpipev run on) over pairs of ranks, two stages per rank, on
a near-zero compute: a 1 x `PROBE_WIDTH` activation through one tiny linear layer per stage. It times the
step and, around every stage forward, backward and the loss (the calls `benchmarks/pipeline_bubble.py`
counts as busy), the compute. `overhead_from_probe` then finds the per-action overhead that, with that
compute and the measured point-to-point latency of the probe's message between the two ranks, makes the
simulated step (trainer/planner/pipeline_sim.py, torch's own order of operations) as long as the measured
one. The message latency is measured apart (trainer.commcheck.time_collective) and solved out, because the
planner counts point-to-point traffic on its own (trainer/planner/communication.py): the figure is the
runtime's work per action beyond its message's latency and bytes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from trainer.planner.pipeline_sim import play_v_schedule

PROBE_SCHEDULE = "zbv"
PROBE_MICROBATCHES = 8
PROBE_WIDTH = 8
PROBE_STEPS = 5
PROBE_WARMUP = 2
# Probes per measurement, of which the median is kept: on 2 shared cores one probe in six read a whole
# timing's messages at ~2 ms instead of ~0.2 ms, and its overhead as 0.
PROBE_ROUNDS = 3
MESSAGE_ITERS = 4  # point-to-point exchanges per timing
MESSAGE_REPEATS = 7  # timings, of which the median is kept


def overhead_from_probe(schedule: str, pp: int, microbatches: int, step_s: float, busy_s: float,
                        message_s: float) -> float:
    """Seconds of pipeline overhead per compute action that explain a measured step.

    `step_s` is the step's wall time, `busy_s` the compute of the busiest rank (seconds in its stages'
    forward and backward calls and the loss), `message_s` one point-to-point message's time between
    neighbouring ranks. The compute is spread over the busiest rank's cost units (`COST`: forward,
    input- and weight-gradient one each, a full backward two), every action gets the same overhead, and a
    neighbour's activation or gradient arrives `message_s` after its producer ends; the overhead is the one
    at which the played-out step equals `step_s` (bisection: the step grows with the overhead). 0 when
    the compute and messages alone already take `step_s` or longer."""
    played = play_v_schedule(schedule, pp, microbatches)
    unit = busy_s / max(played.busy)  # seconds per cost unit: the busiest rank's compute over its units

    def step(overhead: float) -> float:
        return play_v_schedule(schedule, pp, microbatches, unit, overhead, message_s).makespan

    if step(0.0) >= step_s:
        return 0.0
    low, high = 0.0, step_s / min(played.actions)  # at that overhead the step is at least step_s
    for _ in range(60):  # 2**-60 of the bracket: far below a clock's resolution
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < step_s else (low, middle)
    return (low + high) / 2


class _Busy:
    """Seconds spent in wrapped calls (the stages' compute)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def probe_pipeline(group: Any, device: torch.device, microbatches: int = PROBE_MICROBATCHES,
                   steps: int = PROBE_STEPS, warmup: int = PROBE_WARMUP) -> dict[str, float]:
    """Run the probe pipeline on `group` (every rank of it calls this; 2 or more ranks, each holding two
    stages in a V) and return this rank's median step and busy seconds and the point-to-point seconds of
    one probe message (`time_collective`, the ring exchange the calibration's link figures use)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    pp = dist.get_world_size(group)
    rank = dist.get_group_rank(group, dist.get_rank())
    busy = _Busy()
    stages = []
    for index in (rank, 2 * pp - 1 - rank):
        stage = PipelineStage(nn.Linear(PROBE_WIDTH, PROBE_WIDTH).to(device), index, 2 * pp, device, group=group)
        for method in ("forward_maybe_with_nosync", "backward_maybe_with_nosync"):
            setattr(stage, method, busy.wrap(getattr(stage, method)))
        stages.append(stage)
    loss = busy.wrap(lambda output, target: ((output - target) ** 2).sum())
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    inputs = torch.randn(microbatches, PROBE_WIDTH, device=device)
    step_times, busy_times = [], []
    for step in range(warmup + steps):
        dist.barrier(group=group)
        busy.seconds = 0.0
        start = time.perf_counter()
        if rank == 0:  # the V's first and last stage: the inputs and the targets
            schedule.step(inputs, target=torch.zeros_like(inputs))
        else:
            schedule.step()
        if step >= warmup:
            step_times.append(time.perf_counter() - start)
            busy_times.append(busy.seconds)
    message = message_seconds(PROBE_WIDTH, group, device)
    return {"step_s": statistics.median(step_times), "busy_s": statistics.median(busy_times), "message_s": message}


def message_seconds(numel: int, group: Any, device: torch.device) -> float:
    """One point-to-point message's seconds between `group`'s ranks at `numel` fp32 elements: the median of
    `MESSAGE_REPEATS` timings of `MESSAGE_ITERS` exchanges each (`time_collective`). A mean over the
    exchanges absorbed any descheduled wait whole: on 2 shared cores, 181-1439 us for one 32-byte message in six
    probes in a row, which the solve then took from the overhead (44 us instead of 260-370)."""
    from trainer.commcheck import time_collective

    return statistics.median(time_collective("point-to-point", numel, group, MESSAGE_ITERS, device)
                             for _ in range(MESSAGE_REPEATS))


def measure_pipeline_overhead(device: torch.device) -> float | None:
    """Seconds of overhead per pipeline compute action on this machine, every rank of the job taking part at
    once (as in training, where they share it): ranks 2k and 2k + 1 run the probe pipeline together (an odd
    last rank waits), `PROBE_ROUNDS` times, and the median over the pairs and rounds of the overhead each
    pair's slowest rank implies is returned on every rank. None with fewer than 2 ranks (no pipeline to
    run)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if world < 2:
        return None
    pairs = [dist.new_group([first, first + 1]) for first in range(0, world - 1, 2)]  # every rank creates each
    mine = pairs[me // 2] if me // 2 < len(pairs) else None
    overheads = []
    for _ in range(PROBE_ROUNDS):
        measured = probe_pipeline(mine, device) if mine is not None else None
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, measured)
        for first in range(0, world - 1, 2):
            pair = [gathered[first], gathered[first + 1]]
            overheads.append(overhead_from_probe(
                PROBE_SCHEDULE, 2, PROBE_MICROBATCHES, step_s=max(r["step_s"] for r in pair),
                busy_s=max(r["busy_s"] for r in pair), message_s=max(r["message_s"] for r in pair)))
    for group in pairs:
        dist.destroy_process_group(group)
    return statistics.median(overheads)
