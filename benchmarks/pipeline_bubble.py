"""How much of a pipeline step does each stage spend idle? Every schedule against its textbook bubble.

For P = 2 and 4 pipeline ranks (one stage each for gpipe and 1f1b, V = 2 virtual stages each for
interleaved_1f1b and zero_bubble) and M micro-batches per step, the script runs
`strategy=pp` (plugins/strategies/pipeline.py, torch.distributed.pipelining underneath) on a Llama whose
blocks are split evenly over the stages (`embedding_weight = head_weight = 0`), and measures per stage:

- step time: wall time of `strategy.forward_backward` (one schedule step) on that rank, from a barrier
  to the end of the step (which ends with a broadcast of the loss from the last stage, so every rank's
  step ends after the last backward);
- busy time: the stage's own compute, summed over the step: perf_counter timers around every forward
  of the stage module (`PipelineStage.forward_maybe_with_nosync`), every backward
  (`backward_maybe_with_nosync`, which on the last stage starts from the loss, and through which
  zero_bubble's separate weight-gradient passes run too) and the loss itself;
- idle time = step time - busy time, and the idle fraction idle / step.

Idle therefore includes everything that is not this stage's compute: waiting for activations or
gradients from a neighbour (the bubble), the point-to-point copies themselves, and the schedule's
Python bookkeeping. Beside it each stage reports how long its main thread was runnable but waited for a
core during the step (Linux's schedstat): with P processes and their gloo transfer threads on P cores,
that wait slows a stage's compute and bookkeeping and makes its neighbours idle longer, a property of the
machine that no schedule model counts. Steps are timed after `--warmup` steps (the first step also runs torch's shape
inference) and the median over `--steps` steps is reported. torch's 1F1B needs M >= P: smaller M are
skipped for it.

Theory (convention used here: idle as a fraction of the step, on a stage whose per-micro-batch forward
+ backward time t is the same on every stage, communication free): GPipe (Huang et al. 2019) runs
M + P - 1 forward slots and as many backward slots, of which each stage is busy in M, so the bubble is
(P - 1) / (M + P - 1) of the step. 1F1B (PipeDream-Flush, Narayanan et al. 2021, Sec. 2.2) reorders
the same work and has the same bubble; Narayanan et al. write it as (P - 1) / M, the bubble over the
ideal (busy) time, which is the same quantity measured against a different denominator:
idle / busy = (P - 1) / M  <=>  idle / step = (P - 1) / (M + P - 1). Both are printed. 1F1B's gain is
memory (at most P micro-batches of activations in flight instead of M), not a smaller bubble.
Interleaved 1F1B with V stages per rank (Narayanan et al. 2021, Sec. 2.2.2) divides the bubble by V:
idle / busy = (P - 1) / (V M), idle / step = (P - 1) / (V M + P - 1). Zero bubble (Qi et al. 2024, ZB-H1)
splits each backward into input- and weight-gradient halves and fills the bubble with the weight halves:
with forward = input backward = weight backward time, a third of 1F1B's bubble remains, here on V
interleaved stages: idle / busy = (P - 1) / (3 V M) (an estimate under that equal-thirds assumption).

ZBV and DualPipeV (two stages per rank in a V; DualPipeV needs M >= 2P) are measured the same way; their
bubble is the planner's (trainer/planner/pipeline_sim.py: torch's own order of operations played out at
equal forward, input- and weight-gradient times, communication and bookkeeping free).

Beside that pure bubble ("theory"), each point prints the planner's idle prediction with what it counts on top
("planner"): the pipeline runtime's per-action overhead on the critical path
(`trainer.planner.timing.pipeline_time`, the V schedules played out with it) and the point-to-point messages
each rank sends, as the planner's time model counts them on a CPU (exposed: every activation or gradient a
rank sends, `communication.pipeline_sends`, at the measured time of one). Its inputs are measured in the same
launch, before the schedules run, and none is fitted to the points: the overhead per action by the planner's
own calibration probe (trainer/planner/pipeline_overhead.py: a near-zero-compute ZBV pipeline over the pp
ranks, the message latency solved out), one message's time at the activation's size by the calibration's
point-to-point exchange (the median of several timings, `message_seconds`), and the compute is each point's
measured busy time (its mean over the ranks, which the planner would otherwise predict from FLOPs), spread
over the stages by the planner's shares of the FLOPs (`stage_compute_shares`: the blocks evenly here, the
output head and loss on the last stage, so the rank holding it is the slowest and the others wait for it) and,
for zbv and dualpipev, over each stage's forward, input- and weight-gradient passes (`stage_pass_fractions`:
the attention core's backward all in the input-gradient pass). The figure is the mean over the ranks.
"bubble+overhead" is the prediction without the messages. For zbv and dualpipev a last figure, "measured
costs", plays torch's order out with each stage's measured compute per forward, input-, weight-gradient and
full backward (mean seconds per action of the timed steps), the overhead and one message per hand-over between
ranks: what is left between it and the measurement is neither the equal-thirds assumption nor unequal stages
(torch runs the first stage's whole backward in its weight-gradient action, none in the input one).

`--moe` measures instead, for a small MoE under `strategy=3d pp=2 ep=2` (4 processes), the seconds per
step each rank spends in the expert all-to-alls (forward and backward) and how much of it no compute hid:
under 1f1b, under dualpipev run as torch orders it (`strategy.expert_overlap=false`: each overlapped pair's
forward, then its backward) and under dualpipev with the overlap (plugins/strategies/pipeline_overlap.py:
the pair's two passes on two threads taking turns at the all-to-alls).

On a machine with fewer cores than P processes the stages also wait for a core: busy times then
include time-slicing and the figures say more about the machine than about the schedule. Run it with
at least P cores (one intra-op thread per process is used).

    python benchmarks/pipeline_bubble.py      # P = 2, 4; M = 2, 4, 8, 16; all six schedules (several minutes)
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 2 4 8 --schedules 1f1b zbv dualpipev --steps 3 --warmup 1
    python benchmarks/pipeline_bubble.py --moe --steps 8 --warmup 2   # exposed expert all-to-all, 4 processes
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 2 4 --steps 2 --warmup 1 \\
        --dim 64 --layers 4 --seq-len 32 --micro-batch-size 2     # smoke test, ~1 min on 2 cores

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.plugins.activation_checkpointing import NoCheckpointing  # noqa: E402
from trainer.plugins.strategies.pipeline import PipelineParallel  # noqa: E402
from trainer.models import build_meta_model  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402
from trainer.planner.pipeline_overhead import measure_pipeline_overhead, message_seconds  # noqa: E402
from trainer.planner.pipeline_sim import KINDS, play_v_schedule, v_schedule_bubble  # noqa: E402
from trainer.planner.communication import pipeline_sends  # noqa: E402
from trainer.planner.layout import Layout  # noqa: E402
from trainer.planner.params import ModelInventory, inventory  # noqa: E402
from trainer.planner.timing import pipeline_time, stage_compute_shares, stage_pass_fractions  # noqa: E402

V_SCHEDULES = ("zbv", "dualpipev")

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# Stages per rank of each schedule here.
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2, "dualpipev": 2}
RESULT_PREFIX = "PIPELINE_BUBBLE_RESULT "


def theoretical_idle_over_busy(schedule: str, pp: int, microbatches: int) -> float:
    """The bubble over the busy time: (P - 1) / M for GPipe and 1F1B, / (V M) interleaved, / (3 V M) for
    zero bubble (ZB-H1 with equal forward, input- and weight-backward times); x / (1 - x) of the planner's
    fraction x for zbv and dualpipev."""
    if schedule in V_SCHEDULES:
        bubble = v_schedule_bubble(schedule, pp, microbatches)
        return bubble / (1 - bubble)
    virtual = VIRTUAL[schedule]
    return (pp - 1) / (microbatches * virtual * (3 if schedule == "zero_bubble" else 1))


def theoretical_bubble(schedule: str, pp: int, microbatches: int) -> float:
    """The same bubble as a fraction of the step: x / (1 + x) for x = idle / busy; for zbv and dualpipev the
    planner's figure (torch's order of operations played out, trainer/planner/pipeline_sim.py)."""
    if schedule in V_SCHEDULES:
        return v_schedule_bubble(schedule, pp, microbatches)
    ratio = theoretical_idle_over_busy(schedule, pp, microbatches)
    return ratio / (1 + ratio)


def planner_idle(schedule: str, pp: int, microbatches: int, busy_s: list[float], overhead_s: float,
                 message_s: float, layout: Layout, inv: ModelInventory) -> dict[str, Any]:
    """The planner's idle fraction of a point, mean over the ranks: bubble and per-action overhead on the
    critical path (`pipeline_time` with the ranks' measured compute spread over the stages and their passes
    as the planner splits the FLOPs: `stage_compute_shares`, the head on the last stage, and
    `stage_pass_fractions`), then also each rank's sent messages, exposed."""
    even = statistics.mean(busy_s)
    shares = stage_compute_shares(inv, layout)
    passes = stage_pass_fractions(inv, layout) if schedule in V_SCHEDULES else None
    pipes = [pipeline_time(schedule, pp, microbatches, VIRTUAL[schedule], even, overhead_s, shares, r, passes)
             for r in range(pp)]
    messages = statistics.mean(pipeline_sends(layout, r) for r in range(pp)) * message_s
    return {"bubble_overhead_idle_fraction": statistics.mean(p.idle_fraction for p in pipes),
            "planner_idle_fraction": statistics.mean(1 - p.compute_s / (p.step_s + messages) for p in pipes),
            "planner_compute_s_per_stage": [p.compute_s for p in pipes],
            "overhead_s": pipes[0].overhead_s, "messages_s": messages, "actions_per_rank": pipes[0].actions}


def planner_layout(schedule: str, pp: int, microbatches: int, micro_batch_size: int, seq_len: int) -> Layout:
    """The planner's layout of a point: the blocks split evenly (the strategy places them so here, without
    balancing weights), one micro-batch of `micro_batch_size` sequences per pipeline micro-batch."""
    return Layout(world_size=pp, dp_replicate=1, dp_shard=1, tp=1, pp=pp, strategy="pp", dp_flavour="none",
                  micro_batch_size=micro_batch_size, global_batch_size=microbatches * micro_batch_size,
                  seq_len=seq_len, schedule=schedule, virtual_stages=VIRTUAL[schedule], embedding_weight=0.0,
                  head_weight=0.0)


class BusyClock:
    """Seconds of compute of this rank's stage, accumulated by wrapping the stage's compute calls; while
    `recording`, also per (stage, operation kind): the calls of the schedule's actions (`count`) and the
    compute seconds inside them (`wrap` with `attribute`)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.recording = False
        self.current: tuple[int, str] | None = None  # the action running now: (stage, kind)
        self.calls: dict[tuple[int, str], int] = {}
        self.by_kind: dict[tuple[int, str], float] = {}

    def wrap(self, function: Callable[..., Any], attribute: tuple[int, str] | None = None) -> Callable[..., Any]:
        """`function`, timed as compute; while recording, its seconds go to `attribute` or else to the
        action running now."""
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds += elapsed
                key = attribute or self.current
                if self.recording and key is not None:
                    self.by_kind[key] = self.by_kind.get(key, 0.0) + elapsed

        return timed

    def count(self, function: Callable[..., Any], action: Callable[..., tuple[int, str]]) -> Callable[..., Any]:
        """`function` (one of the schedule's actions), counted as the (stage, kind) `action(*args, **kwargs)`
        names, which the compute inside it is attributed to."""
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            key = action(*args, **kwargs)
            if self.recording:
                self.calls[key] = self.calls.get(key, 0) + 1
            self.current = key
            try:
                return function(*args, **kwargs)
            finally:
                self.current = None

        return counted

    def per_call(self) -> dict[str, float]:
        """Mean compute seconds per action of each recorded "stage/kind"."""
        return {f"{stage}/{kind}": self.by_kind.get((stage, kind), 0.0) / calls
                for (stage, kind), calls in self.calls.items() if calls}


def instrument(strategy: PipelineParallel, clock: BusyClock) -> None:
    """Time the stage's forwards, backwards and loss (after the schedule has built its stages; a new
    micro-batch count builds new stages, hence the flags), each also by stage and the schedule's action
    kind: F (forward, and the loss on the last stage), I and B (`backward_one_chunk` without and with the
    weight gradient), W (`backward_weight_one_chunk`; on the first stage torch runs its whole backward
    there and none in I)."""
    assert strategy.pipeline is not None
    last = strategy.pipeline.num_stages - 1
    if not getattr(strategy, "_bubble_timed", False):
        strategy.compute_loss = clock.wrap(strategy.compute_loss, (last, "F"))  # type: ignore[method-assign]
        strategy._bubble_timed = True  # type: ignore[attr-defined]
    for stage in strategy.pipeline.stages:
        if not getattr(stage, "_bubble_timed", False):
            for method in ("forward_maybe_with_nosync", "backward_maybe_with_nosync"):
                setattr(stage, method, clock.wrap(getattr(stage, method)))
            i = stage.stage_index
            stage.forward_one_chunk = clock.count(  # type: ignore[method-assign]
                stage.forward_one_chunk, lambda *a, i=i, **k: (i, "F"))
            stage.backward_one_chunk = clock.count(  # type: ignore[method-assign]
                stage.backward_one_chunk, lambda *a, i=i, **k: (i, "B" if k.get("full_backward", True) else "I"))
            stage.backward_weight_one_chunk = clock.count(  # type: ignore[method-assign]
                stage.backward_weight_one_chunk, lambda *a, i=i, **k: (i, "W"))
            stage._bubble_timed = True  # type: ignore[attr-defined]


def core_wait_s() -> float | None:
    """Seconds this thread has spent runnable but waiting for a core (Linux's /proc/thread-self/schedstat,
    its second field), None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def measure(strategy: PipelineParallel, parts: list[torch.nn.Module],
            microbatches: list[tuple[torch.Tensor, torch.Tensor]], clock: BusyClock, steps: int,
            warmup: int) -> dict[str, Any]:
    """Median step time, busy time and idle fraction of this rank over `steps` timed steps (the
    timers are installed during the first, untimed, step), and the mean seconds per call of each of its
    stages' operation kinds over those steps."""
    step_times, busy_times, core_waits = [], [], []
    clock.calls, clock.by_kind = {}, {}
    for step in range(warmup + steps):
        for part in parts:
            part.zero_grad(set_to_none=True)
        dist.barrier()
        clock.seconds = 0.0
        clock.recording = step >= warmup
        waited = core_wait_s()
        start = time.perf_counter()
        strategy.forward_backward(parts, microbatches)
        elapsed = time.perf_counter() - start
        if waited is not None:
            waited = (core_wait_s() or waited) - waited
        instrument(strategy, clock)  # the schedule and its stages exist after the first step
        if step >= warmup:
            step_times.append(elapsed)
            busy_times.append(clock.seconds)
            core_waits.append(waited)
    clock.recording = False
    idle = [max(0.0, s - b) / s for s, b in zip(step_times, busy_times, strict=True)]
    known = [w for w in core_waits if w is not None]
    return {"step_s": statistics.median(step_times), "busy_s": statistics.median(busy_times),
            "idle_fraction": statistics.median(idle), "per_call_s": clock.per_call(),
            "core_wait_s": statistics.median(known) if known else None}


def measured_costs_idle(schedule: str, pp: int, microbatches: int, per_call: dict[str, float], overhead_s: float,
                        message_s: float) -> float | None:
    """For zbv and dualpipev: the idle fraction of torch's order of operations played out with each stage's
    measured seconds per forward, input-, weight-gradient and full backward (where the equal-thirds and
    equal-stages assumptions do not hold), the per-action overhead and one message per hand-over between
    ranks; None for the closed-form schedules."""
    if schedule not in V_SCHEDULES:
        return None
    costs = tuple(tuple(per_call.get(f"{stage}/{kind}", 0.0) for kind in KINDS) for stage in range(2 * pp))
    return play_v_schedule(schedule, pp, microbatches, overhead=overhead_s, message=message_s,
                           stage_costs=costs).idle


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = LlamaConfig(name="bubble", vocab_size=256, dim=args.dim, n_layers=args.layers,
                         n_heads=max(1, args.dim // 32), ffn_hidden_dim=4 * args.dim, max_seq_len=args.seq_len)
    results = []
    clock = BusyClock()
    # the planner's machine figures, measured first, with every pp rank taking part
    overhead_s = measure_pipeline_overhead(torch.device("cpu")) or 0.0
    activation = args.micro_batch_size * args.seq_len * args.dim
    message_s = message_seconds(activation, dist.group.WORLD, torch.device("cpu"))
    if rank == 0:
        print(f"P={pp} pipeline runtime overhead {overhead_s * 1e6:.0f} us per compute action; one "
              f"{activation * 4 / 1e3:.0f} kB message {message_s * 1e3:.2f} ms", flush=True)
    for schedule in args.schedules:
        strategy = PipelineParallel(schedule=schedule, virtual_stages=VIRTUAL[schedule], embedding_weight=0.0,
                                    head_weight=0.0, init="full")
        strategy.setup_environment("cpu", 1, pp=pp)
        torch.manual_seed(0)
        parts = strategy.setup_model(build_meta_model(config), NoCheckpointing(), compile=False)
        for microbatches in args.microbatches:
            try:  # e.g. torch's 1F1B needs M >= P, the interleaved schedules M a multiple of P
                strategy.validate_pipeline(num_layers=args.layers, pp=pp, num_microbatches=microbatches)
            except ValueError:
                continue
            generator = torch.Generator().manual_seed(microbatches)
            batches = [(torch.randint(0, 256, (args.micro_batch_size, args.seq_len), generator=generator),
                        torch.randint(0, 256, (args.micro_batch_size, args.seq_len), generator=generator))
                       for _ in range(microbatches)]
            mine = measure(strategy, parts, batches, clock, args.steps, args.warmup)
            per_stage: list[Any] = [None] * pp
            dist.all_gather_object(per_stage, mine)
            per_call = {key: value for s in per_stage for key, value in s["per_call_s"].items()}
            row = {
                "pp": pp, "schedule": schedule, "microbatches": microbatches,
                "step_s": max(s["step_s"] for s in per_stage),
                "busy_s_per_stage": [s["busy_s"] for s in per_stage],
                "idle_fraction_per_stage": [s["idle_fraction"] for s in per_stage],
                "idle_fraction_mean": statistics.mean(s["idle_fraction"] for s in per_stage),
                "core_wait_s_per_stage": [s["core_wait_s"] for s in per_stage],
                "virtual_stages": VIRTUAL[schedule],
                "theory_idle_fraction": theoretical_bubble(schedule, pp, microbatches),
                "theory_idle_over_busy": theoretical_idle_over_busy(schedule, pp, microbatches),
                "action_overhead_s": overhead_s, "message_s": message_s,
                **planner_idle(schedule, pp, microbatches, [s["busy_s"] for s in per_stage], overhead_s, message_s,
                               planner_layout(schedule, pp, microbatches, args.micro_batch_size, args.seq_len),
                               inventory(config)),
                "per_call_s": per_call,
                "measured_costs_idle_fraction": measured_costs_idle(schedule, pp, microbatches, per_call, overhead_s,
                                                                    message_s),
            }
            results.append(row)
            if rank == 0:
                stages = " ".join(f"{f:.3f}" for f in row["idle_fraction_per_stage"])
                print(f"P={pp} {schedule:16s} M={microbatches:2d}: step {row['step_s'] * 1e3:8.1f} ms, idle per "
                      f"stage [{stages}], mean {row['idle_fraction_mean']:.3f}, theory "
                      f"{row['theory_idle_fraction']:.3f}, bubble+overhead {row['bubble_overhead_idle_fraction']:.3f}, "
                      f"planner {row['planner_idle_fraction']:.3f}"
                      + (f", measured costs {row['measured_costs_idle_fraction']:.3f}"
                         if row["measured_costs_idle_fraction"] is not None else "")
                      + (", waiting for a core [" + " ".join(f"{w * 1e3:.0f}" for w in row["core_wait_s_per_stage"])
                         + "] ms" if None not in row["core_wait_s_per_stage"] else ""), flush=True)
        del parts, strategy
    if rank == 0:
        print(RESULT_PREFIX + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# MoE under 3d: 4 layers over pp=2 (2 stages per rank in the V schedules), 4 experts over ep=2 of the dp=2
# ranks; micro-batch 2 of 16 sequences: 4 pipeline micro-batches per dp rank (DualPipeV's minimum 2 pp).
MOE_RUN = ["model=tiny_moe", "model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
           "model.n_experts=4", "model.moe_hidden_dim=128", "trainer.seq_len=64", "trainer.global_batch_size=16",
           "trainer.micro_batch_size=2", "trainer.log_every=1", "trainer.val_every=0", "callbacks=none",
           "lr_schedule.warmup_steps=1", "data.max_bytes=1000000", "trainer.peak_flops=1e12",
           "strategy=3d", "pp=2", "ep=2", "trainer.devices=4", "strategy.data_parallel=fsdp"]
MOE_SCHEDULES = {"1f1b": ["strategy.schedule=1f1b"],
                 "dualpipev": ["strategy.schedule=dualpipev", "strategy.virtual_stages=2",
                               "strategy.expert_overlap=false"],
                 "dualpipev+overlap": ["strategy.schedule=dualpipev", "strategy.virtual_stages=2",
                                       "strategy.expert_overlap=true"]}


def moe_worker(args: argparse.Namespace) -> None:
    """Per schedule: the trainer's own step over `args.steps + args.warmup` steps, with the seconds this rank
    spends in the expert-parallel all-to-alls (token counts, dispatch and combine in the forward; the
    gradients' exchanges in the backward) and the part of them no compute covered, summed per step. Both come
    from `ExpertOverlap`'s clock (plugins/strategies/pipeline_overlap.py) at the MoE layers' exchange
    boundaries: without the overlap every exchange blocks its rank (all exposed); with it, per phase between
    two turns, a thread's exchange beyond the other thread's compute is exposed."""
    import tempfile

    from trainer.config import compose
    from trainer.config.errors import ConfigError
    from trainer.plugins.strategies.pipeline_overlap import ExpertOverlap
    from trainer.run import build_trainer

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = []
    for schedule, overrides in MOE_SCHEDULES.items():
        steps = args.warmup + args.steps
        with tempfile.TemporaryDirectory() as out:
            try:
                trainer = build_trainer(compose(MOE_RUN + overrides + [f"trainer.max_steps={steps}"]), Path(out))
            except ConfigError as refused:  # a layout config validation refuses: reported, not timed
                rows.append({"schedule": schedule, "refused": str(refused)})
                if dist.get_rank() == 0:
                    print(f"MOE {schedule:18s}: refused by config validation: {refused}", flush=True)
                continue
            pipeline = trainer.strategy.pipeline
            if pipeline.expert_overlap is None:  # the clock alone, the schedule's own order
                pipeline.expert_overlap = ExpertOverlap(pairing=False)
            clock = pipeline.expert_overlap
            per_step: list[tuple[float, float]] = []
            step_times: list[float] = []
            waits: list[float] = []
            original = trainer.training_step

            def timed_step(*a: Any, **k: Any) -> Any:
                dist.barrier()
                clock.reset()
                start = time.perf_counter()
                result = original(*a, **k)
                step_times.append(time.perf_counter() - start)
                per_step.append((clock.comm_s, clock.exposed_s))
                waits.append(clock.waited_s)
                return result

            trainer.training_step = timed_step  # type: ignore[method-assign]
            trainer.fit()
        timed = per_step[args.warmup:]
        mine = {"a2a_s": statistics.median(c for c, _ in timed), "exposed_s": statistics.median(e for _, e in timed),
                "step_s": statistics.median(step_times[args.warmup:]), "waited_s": statistics.median(waits[args.warmup:])}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rows.append({"schedule": schedule, "a2a_s_per_rank": [g["a2a_s"] for g in gathered],
                     "exposed_a2a_s_per_rank": [g["exposed_s"] for g in gathered],
                     "step_s": max(g["step_s"] for g in gathered),
                     "a2a_s_mean": statistics.mean(g["a2a_s"] for g in gathered),
                     "exposed_a2a_s_mean": statistics.mean(g["exposed_s"] for g in gathered),
                     "turn_wait_s_mean": statistics.mean(g["waited_s"] for g in gathered)})
        if dist.get_rank() == 0:
            row = rows[-1]
            print(f"MOE {schedule:18s}: step {row['step_s'] * 1e3:8.1f} ms, all-to-all per step "
                  f"{row['a2a_s_mean'] * 1e3:7.1f} ms, exposed {row['exposed_a2a_s_mean'] * 1e3:7.1f} ms "
                  f"(mean of ranks; {100 * row['exposed_a2a_s_mean'] / row['step_s']:.1f}% of the step), waiting for "
                  f"the partner thread {row['turn_wait_s_mean'] * 1e3:.1f} ms", flush=True)
    if dist.get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_moe(argv: list[str], args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
               str(Path(__file__).resolve()), "--worker", *argv]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    rows = []
    for line in result.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            rows = json.loads(line[len(RESULT_PREFIX):])
        elif line.startswith("MOE "):
            print(line, flush=True)
    if result.returncode != 0:
        sys.exit(f"the MoE run failed:\n{result.stderr[-4000:]}")
    print(json.dumps({"moe": rows, "settings": {"overrides": MOE_RUN, "steps": args.steps, "warmup": args.warmup,
                                                 "cpu_count": os.cpu_count(), "torch": torch.__version__}}))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (one process per stage)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16], help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per point (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first infers shapes)")
    parser.add_argument("--dim", type=int, default=256, help="model width")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks, split evenly over the stages")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                        help="schedules to measure")
    parser.add_argument("--moe", action="store_true",
                        help="instead: exposed expert all-to-all time per step of a MoE under 3d pp=2 x ep=2 "
                             "(4 processes), 1f1b vs dualpipev")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        sys.exit("--warmup and --steps must be >= 1 (the first step of each point installs the timers)")
    if args.worker:
        moe_worker(args) if args.moe else worker(args)
        return
    if args.moe:
        run_moe(argv, args)
        return
    for pp in args.pp:
        if args.layers % (2 * pp):
            sys.exit(f"--layers {args.layers} must be divisible by 2 x every --pp value (even stages, 2 per rank "
                     f"for the interleaved schedules), got {pp}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows: list[dict[str, Any]] = []
    for pp in args.pp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
                   str(Path(__file__).resolve()), "--worker", *argv]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        for line in result.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                rows.extend(json.loads(line[len(RESULT_PREFIX):]))
            elif line.startswith("P="):
                print(line, flush=True)
        if result.returncode != 0:
            sys.exit(f"pp={pp} failed:\n{result.stderr[-4000:]}")
    settings = {"dim": args.dim, "layers": args.layers, "seq_len": args.seq_len,
                "micro_batch_size": args.micro_batch_size, "steps": args.steps, "warmup": args.warmup,
                "cpu_count": os.cpu_count(), "torch": torch.__version__,
                "convention": "idle fraction = (step - busy) / step per stage; theory x / (1 + x) with x = "
                              "(P-1)/M (gpipe, 1f1b), (P-1)/(VM) (interleaved_1f1b), (P-1)/(3VM) (zero_bubble); "
                              "planner: 1 - compute / (pipeline_time's step + messages sent x one message's time)"}
    print(json.dumps({"results": rows, "settings": settings}))


if __name__ == "__main__":
    main()
