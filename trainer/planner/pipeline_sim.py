"""The V-shaped pipeline schedules (ZBV, DualPipeV) played out on a clock: their bubble and the activations
they hold, from the order of operations torch itself runs.

The closed forms of the papers hold in the steady state only: ZB-V's bubble (p - 1)(T_F + T_B - 2 T_W)
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6: zero when forward, input-gradient and
weight-gradient times are equal, at 1F1B's activation memory) and DualPipeV's (P - 1)(F&B + B - 3W)
with 2P + 1 chunks of activations per rank (DeepSeek-V3 technical report 2024, table 2, for DualPipe over
2P ranks; DeepSeek's DualPipe repository gives the same for DualPipeV folded onto P ranks, with F&B the
time of one micro-batch's forward chunk overlapped with another's backward chunk and B a full backward
chunk). At the few micro-batches per step that fit in memory (torch's ZBV runs any M, filling the warm-up
with fewer than 2P - 1 micro-batches; DualPipeV needs M >= 2P) the warm-up and the cool-down dominate, so
the planner does not use the closed forms: it takes each rank's list of operations from torch's schedule
class (`_calculate_single_rank_operations`, the list `step()` runs) and plays them out, every operation
starting when its rank is free and its inputs exist:

- F(s, i) (forward of micro-batch i on stage s) after F(s - 1, i);
- I(s, i) (input gradient) and B(s, i) (full backward: input and weight gradients) after I/B(s + 1, i)
  and F(s, i); W(s, i) (weight gradient) after I(s, i). DualPipeV's overlapped pair F + B runs as its
  two operations one after the other (the compute of both runs on the rank either way; the expert
  overlap, plugins/strategies/pipeline_overlap.py, hides communication, which this model leaves out), and
  both of its outputs leave the rank at the pair's end: torch's lowering (`_add_send_recv`) puts the pair's
  sends after it. With that, DualPipeV's idle per rank at equal thirds is the report's (P - 1)(F&B + B - 3W)
  = 2 (P - 1) units at every M >= 2P (F&B = 3 units, the pair's compute back to back); counting the pair's
  forward as sent at its own end gave half of it, and the measured idle twice the planner's;
- every chunk is half of a rank's layers; F, I and W each cost one unit (the equal-thirds assumption of
  both papers), B two; communication is free.

The bubble is then 1 - busy / makespan averaged over the ranks (every rank does 6M units), and the
activations a rank holds at its peak are the chunks whose forward ran and whose weight gradient has not
(the weight-gradient pass still reads the saved inputs), in units of the rank's two chunks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

V_SCHEDULE_CLASSES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
# Unit costs per chunk (half a rank's layers): forward, input gradient, weight gradient, full backward.
COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


def _torch_order(schedule: str, pp: int, microbatches: int) -> dict[int, list[tuple[tuple[str, int, int], ...]]]:
    """Each rank's actions in the order torch runs them, each a tuple of its compute operations as (kind,
    stage, micro-batch): one operation, or DualPipeV's overlapped pair (its forward, then its backward)."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, V_SCHEDULE_CLASSES[schedule])
    # the method reads only these attributes of the schedule (torch 2.13), not its stages
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=2 * pp)
    order: dict[int, list[tuple[tuple[str, int, int], ...]]] = {}
    for rank in range(pp):
        order[rank] = [tuple((sub.computation_type.value, sub.stage_index, sub.microbatch_index)
                             for sub in action.sub_actions or (action,))
                       for action in cls._calculate_single_rank_operations(state, rank) if action is not None]
    return order


def v_stage_rank(stage: int, pp: int) -> int:
    """The rank that holds `stage` in a V: rank r holds stages r and 2P - 1 - r."""
    return stage if stage < pp else 2 * pp - 1 - stage


@dataclass(frozen=True)
class Played:
    """One step of a V schedule played out: times in the caller's unit (cost units, or seconds)."""

    makespan: float  # the step: from the first operation's start to the last one's end, over all ranks
    busy: tuple[float, ...]  # per rank, its compute (the operations' own costs, no overhead)
    actions: tuple[int, ...]  # per rank, its compute operations (each pays `overhead` once)
    in_flight: tuple[float, ...]  # per rank, peak in-flight micro-batches in units of its two chunks

    @property
    def idle(self) -> float:
        """Mean over the ranks of 1 - compute / step: the bubble, plus the overhead when there is one."""
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy)


# Stage costs (`play_v_schedule`'s `stage_costs`) are given per stage in this order of operation kinds.
KINDS = ("F", "I", "W", "B")


@functools.lru_cache(maxsize=1024)
def play_v_schedule(schedule: str, pp: int, microbatches: int, unit: float = 1.0, overhead: float = 0.0,
                    message: float = 0.0, stage_costs: tuple[tuple[float, ...], ...] | None = None) -> Played:
    """Play torch's order of operations out: every operation costs its `COST` x `unit` of compute plus
    `overhead` (the pipeline runtime's own work per operation on its rank: bookkeeping, issuing and waiting
    on its sends and receives), and an input produced on another rank arrives `message` after its
    producer ends (the point-to-point transfer). All in one unit (cost units, or seconds). `stage_costs`,
    when given, replaces `COST` x `unit` by each stage's own compute per operation kind (`KINDS` order;
    e.g. measured, where the equal-thirds assumption and equal stages do not hold)."""
    order = _torch_order(schedule, pp, microbatches)
    last = 2 * pp - 1
    done: dict[tuple[str, int, int], float] = {}  # an output's end on its own rank
    sent: dict[tuple[str, int, int], float] = {}  # when it leaves for another rank: its action's end
    clock = [0.0] * pp
    position = [0] * pp
    held = [0] * pp
    peak = [0] * pp
    busy = [0.0] * pp

    def ready(rank: int, kind: str, stage: int, mb: int) -> float | None:
        needs: list[tuple[str, int, int]] = []
        if kind == "F" and stage > 0:
            needs.append(("F", stage - 1, mb))
        if kind in ("I", "B"):
            needs.append(("F", stage, mb))
            if stage < last:
                needs.append(("grad", stage + 1, mb))
        if kind == "W":
            needs.append(("grad", stage, mb))
        start = 0.0
        for need in needs:
            # a neighbour's activation or gradient crosses to this rank; a stage's own F or grad does not
            crosses = need[1] != stage and v_stage_rank(need[1], pp) != rank
            end = (sent if crosses else done).get(need)
            if end is None:
                return None
            start = max(start, end + (message if crosses else 0.0))
        return start

    def run(rank: int, operation: tuple[str, int, int], start: float) -> float:
        kind, stage, mb = operation
        compute = stage_costs[stage][KINDS.index(kind)] if stage_costs else COST[kind] * unit
        end = max(clock[rank], start) + overhead + compute
        clock[rank], busy[rank] = end, busy[rank] + compute
        done[operation] = end
        if kind in ("I", "B"):
            done[("grad", stage, mb)] = end
        held[rank] += 1 if kind == "F" else -1 if kind in ("W", "B") else 0
        peak[rank] = max(peak[rank], held[rank])
        return end

    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(order[rank]):
                action = order[rank][position[rank]]
                # each operation of a pair waits for its own input only, but torch sends both outputs after
                # the pair (_add_send_recv puts the pair's sends after it)
                starts = [ready(rank, *operation) for operation in action]
                if any(start is None for start in starts):
                    break
                for operation, start in zip(action, starts, strict=True):
                    end = run(rank, operation, start)
                for kind, stage, mb in action:
                    sent[(kind, stage, mb)] = end
                    if kind in ("I", "B"):
                        sent[("grad", stage, mb)] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} with pp={pp}, M={microbatches}: the operations wait on each other")
    return Played(makespan=max(clock), busy=tuple(busy), actions=tuple(sum(map(len, order[r])) for r in range(pp)),
                  in_flight=tuple(p / 2 for p in peak))


def simulate_v_schedule(schedule: str, pp: int, microbatches: int) -> tuple[float, tuple[float, ...]]:
    """(bubble: mean idle fraction over the ranks, peak in-flight micro-batches of each rank), at unit costs
    with free communication and bookkeeping."""
    played = play_v_schedule(schedule, pp, microbatches)
    return played.idle, played.in_flight


def v_schedule_bubble(schedule: str, pp: int, microbatches: int) -> float:
    """Mean idle fraction of a step of `schedule` (zbv, dualpipev) over its pp ranks."""
    return simulate_v_schedule(schedule, pp, microbatches)[0]


def v_schedule_in_flight(schedule: str, pp: int, microbatches: int, pp_rank: int) -> float:
    """Micro-batches whose activations `pp_rank` holds at its peak, in units of all its layers."""
    return simulate_v_schedule(schedule, pp, microbatches)[1][pp_rank]


def describe(schedule: str, pp: int, microbatches: int) -> dict[str, Any]:
    """The simulation's figures, for reports and benchmarks."""
    bubble, in_flight = simulate_v_schedule(schedule, pp, microbatches)
    return {"schedule": schedule, "pp": pp, "microbatches": microbatches, "bubble": bubble,
            "in_flight": list(in_flight)}
