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
  and F(s, i); W(s, i) (weight gradient) after I(s, i); DualPipeV's overlapped pair F + B runs as its
  two operations one after the other (the compute of both runs on the rank either way; the expert
  overlap, plugins/strategies/pipeline_overlap.py, hides communication, which this model leaves out);
- every chunk is half of a rank's layers; F, I and W each cost one unit (the equal-thirds assumption of
  both papers), B two; communication is free.

The bubble is then 1 - busy / makespan averaged over the ranks (every rank does 6M units), and the
activations a rank holds at its peak are the chunks whose forward ran and whose weight gradient has not
(the weight-gradient pass still reads the saved inputs), in units of the rank's two chunks.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

V_SCHEDULE_CLASSES = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
# Unit costs per chunk (half a rank's layers): forward, input gradient, weight gradient, full backward.
COST = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}


def _torch_order(schedule: str, pp: int, microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """Each rank's compute operations as (kind, stage, micro-batch), in the order torch runs them."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, V_SCHEDULE_CLASSES[schedule])
    # the method reads only these attributes of the schedule (torch 2.13), not its stages
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=2 * pp)
    kinds = {"F": "F", "I": "I", "W": "W", "B": "B"}
    order: dict[int, list[tuple[str, int, int]]] = {}
    for rank in range(pp):
        ops: list[tuple[str, int, int]] = []
        for action in cls._calculate_single_rank_operations(state, rank):
            if action is None:
                continue
            for sub in action.sub_actions or (action,):
                kind = kinds[sub.computation_type.value]
                ops.append((kind, sub.stage_index, sub.microbatch_index))
        order[rank] = ops
    return order


@functools.lru_cache(maxsize=256)
def simulate_v_schedule(schedule: str, pp: int, microbatches: int) -> tuple[float, tuple[float, ...]]:
    """(bubble: mean idle fraction over the ranks, peak in-flight micro-batches of each rank)."""
    order = _torch_order(schedule, pp, microbatches)
    last = 2 * pp - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    position = [0] * pp
    held = [0] * pp
    peak = [0] * pp
    busy = [0.0] * pp

    def ready(kind: str, stage: int, mb: int) -> float | None:
        needs: list[tuple[str, int, int]] = []
        if kind == "F" and stage > 0:
            needs.append(("F", stage - 1, mb))
        if kind in ("I", "B"):
            needs.append(("F", stage, mb))
            if stage < last:
                needs.append(("grad", stage + 1, mb))
        if kind == "W":
            needs.append(("grad", stage, mb))
        times = [done.get(n) for n in needs]
        return None if any(t is None for t in times) else max([0.0, *times])  # type: ignore[type-var]

    remaining = sum(len(ops) for ops in order.values())
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(order[rank]):
                kind, stage, mb = order[rank][position[rank]]
                start = ready(kind, stage, mb)
                if start is None:
                    break
                end = max(clock[rank], start) + COST[kind]
                clock[rank], busy[rank] = end, busy[rank] + COST[kind]
                done[(kind, stage, mb)] = end
                if kind in ("I", "B"):
                    done[("grad", stage, mb)] = end
                held[rank] += 1 if kind == "F" else -1 if kind in ("W", "B") else 0
                peak[rank] = max(peak[rank], held[rank])
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} with pp={pp}, M={microbatches}: the operations wait on each other")
    makespan = max(clock)
    bubble = sum(1 - b / makespan for b in busy) / pp
    return bubble, tuple(p / 2 for p in peak)


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
