"""How many all-gathers a pipeline rank's FSDP2 units issue per step, from the order torch runs its actions.

Without pipelining the planner counts FSDP2's gathers per micro-batch (communication.py). Under a pipeline
schedule a unit's parameters outlive a micro-batch: torch's stages turn FSDP2's resharding after the
backward off for every micro-batch but the last (`PipelineStage.backward_maybe_with_nosync`), so a unit
gathered by a backward stays gathered until a forward reshards it again, and the multi-stage schedules
(interleaved_1f1b, zero_bubble, zbv, dualpipev: `_PipelineScheduleRuntime`) gather a stage's units
ahead of its actions with explicit UNSHARD/RESHARD actions (`_add_unshard_reshard`, at most 3 stages
gathered at a time). A unit is therefore gathered by:

- an UNSHARD of its stage, when sharded then (and a RESHARD frees it);
- a forward (F), a full or input-gradient backward (B, I) or a weight-gradient pass (W: the stage gathers
  its units first, `PrecisionStage.backward_maybe_with_nosync`) of its stage, when sharded then;

and freed again after every forward when it reshards after the forward (FSDP2's `reshard_after_forward`:
every block but a stage's last, unless `reshard_last_block`; the stage's root, whose flag this trainer sets
explicitly, so FSDP2's keep-the-root default does not apply), and at the end of the step. This count was
checked against the all-gathers rank 0 recorded (torch's flight recorder) at pp=2 x dp=2 under fsdp, M=4:
21 a step under 1f1b, 17 under zbv and dualpipev, where the per-micro-batch count gave 40 and 32
(tests/test_pipeline.py runs the comparison).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

from trainer.planner.layout import V_SCHEDULES, Layout
from trainer.planner.memory import RankCoords, block_param_specs, rank_numel, rank_part
from trainer.planner.params import ModelInventory

# The runtime schedules' actions on their units (`_PipelineScheduleRuntime`).
# Stages torch's runtime keeps gathered at a time (`_add_unshard_reshard`'s default `max_active_stages`).
MAX_ACTIVE_STAGES = 3
RUNTIME_SCHEDULES = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "zero_bubble": "ScheduleInterleavedZeroBubble",
                     "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


@functools.lru_cache(maxsize=1024)
def rank_actions(schedule: str, pp: int, microbatches: int, virtual_stages: int,
                 pp_rank: int) -> tuple[tuple[str, int], ...]:
    """The actions on `pp_rank`'s stages in the order torch runs them, as (kind, stage): F, B, I, W, and U / R
    (UNSHARD / RESHARD of a stage's units) where torch's runtime issues them. gpipe: every forward, then
    every backward; 1f1b: min(M, P - r) forwards, then a backward and a forward in turn, then the remaining
    backwards (`Schedule1F1B._step_microbatches`); the others: torch's own list, lowered with its
    UNSHARD/RESHARD actions."""
    if schedule == "gpipe":
        return (("F", pp_rank),) * microbatches + (("B", pp_rank),) * microbatches
    if schedule == "1f1b":
        warmup = min(microbatches, pp - pp_rank)
        steady = [("B", pp_rank), ("F", pp_rank)] * (microbatches - warmup)
        return (("F", pp_rank),) * warmup + tuple(steady) + (("B", pp_rank),) * warmup
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, RUNTIME_SCHEDULES[schedule])
    local = 2 if schedule in V_SCHEDULES else virtual_stages
    rounds = max(1, microbatches // pp)
    # the attributes `_calculate_single_rank_operations` reads (torch 2.13), not the stages
    state = SimpleNamespace(pp_group_size=pp, _n_microbatches=microbatches, num_stages=pp * local,
                            _num_stages=pp * local, n_local_stages=local, number_of_rounds=rounds,
                            microbatches_per_round=microbatches // rounds)
    compute = [action for action in cls._calculate_single_rank_operations(state, pp_rank) if action is not None]
    lowered = schedules._add_unshard_reshard(compute, MAX_ACTIVE_STAGES)
    out: list[tuple[str, int]] = []
    for action in lowered:
        for sub in action.sub_actions or (action,):
            kind = {"UNSHARD": "U", "RESHARD": "R"}.get(sub.computation_type.value, sub.computation_type.value)
            out.append((kind, sub.stage_index))
    return tuple(out)


def unit_gathers(actions: tuple[tuple[str, int], ...], stage: int, reshards_after_forward: bool) -> int:
    """All-gathers per step of one FSDP2 unit of `stage` (the rules in the module docstring)."""
    gathered, gathers = False, 0
    for kind, of in actions:
        if of != stage:
            continue
        if kind == "R":
            gathered = False
            continue
        if not gathered:
            gathers += 1
            gathered = True
        if kind == "F" and reshards_after_forward:
            gathered = False
    return gathers


@functools.lru_cache(maxsize=4096)
def stage_unit_gathers(schedule: str, pp: int, microbatches: int, virtual_stages: int, pp_rank: int, stage: int,
                       reshards_after_forward: bool) -> int:
    """`unit_gathers` over `rank_actions` (cached: the search asks for the same few schedules thousands of
    times)."""
    return unit_gathers(rank_actions(schedule, pp, microbatches, virtual_stages, pp_rank), stage,
                        reshards_after_forward)


def pipeline_gathers(inv: ModelInventory, layout: Layout, coords: RankCoords) -> tuple[int, float, int]:
    """(all-gathers per step, elements they gather per step, FSDP2 units holding parameters) of one pipeline
    rank under a sharded flavour: one unit per block (and one per MoE layer's experts under ep), each of its
    stages' blocks an equal share of the rank's block parameters, and a root on the first stage (the
    embedding) and on the last (norm, head, MTP modules), with the rank's other parameters."""
    part = rank_part(inv, layout, coords.pp)
    stages = layout.stages_of_rank(coords.pp)
    full, _ = rank_numel(inv, layout, coords)
    block_numel = 0
    for spec, copies in block_param_specs(inv, layout, coords.pp):
        shape = spec.local_shape(layout.tp)
        block_numel += copies * math.prod(shape) // (layout.ep if spec.expert and layout.ep > 1 else 1)
    per_block = block_numel / part.layers if part.layers else 0.0
    experts = layout.ep > 1 and inv.n_experts > 0
    last_stage = layout.pp * (2 if layout.schedule in V_SCHEDULES else layout.virtual_stages) - 1
    embedding = sum(math.prod(spec.local_shape(layout.tp)) for spec in inv.embedding)
    roots = {stage: 0.0 for stage in stages if stage in (0, last_stage)}
    if len(roots) == 2:
        roots[0] = float(min(embedding, full - block_numel))
        roots[last_stage] = full - block_numel - roots[0]
    elif roots:
        roots[next(iter(roots))] = float(full - block_numel)
    count, numel, units = 0, 0.0, 0
    schedule = (layout.schedule, layout.pp, layout.num_microbatches, layout.virtual_stages, coords.pp)
    for stage, layers in zip(stages, part.stage_layers, strict=True):
        resharding = stage_unit_gathers(*schedule, stage, layout.reshard_after_forward)
        kept = stage_unit_gathers(*schedule, stage, layout.reshard_after_forward and layout.reshard_last_block)
        block_gathers = [resharding] * max(0, layers - 1) + [kept] * min(1, layers)
        count += sum(block_gathers) + (resharding * layers if experts else 0)  # the experts' own units
        numel += sum(block_gathers) * per_block
        units += layers * (2 if experts else 1)
        if stage in roots:
            count += resharding
            numel += resharding * roots[stage]
            units += 1
    return count, numel, units
