"""Where the pipeline cuts the model: pure functions of the layer count, the stage count and the weights.

`stage_layer_ranges` decides which transformer blocks each stage holds (balanced by cost, or as given),
`stage_indices_of_rank` which stages a pp rank holds (the looped placement r, r + P, r + 2P, ... of the
interleaved schedules, or the V placement r, 2P - 1 - r of ZBV and DualPipeV), and `split_model` cuts a (meta or materialized) model into those stages. No
processes are involved: the planner (`trainer.planner.memory`) and the unit tests call them directly,
and `trainer.plugins.strategies.pipeline` re-exports them.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional, Sequence

import torch.nn as nn

from trainer.models import family_of


def stage_layer_ranges(num_layers: int, num_stages: int, *, layers_per_stage: Optional[Sequence[int]] = None,
                       embedding_weight: float = 1.0, head_weight: float = 1.0) -> list[range]:
    """Contiguous layer ranges, one per pipeline stage, covering `range(num_layers)` exactly.

    With `layers_per_stage` the counts are taken as given (validated: one count per stage, each >= 1,
    summing to `num_layers`). Otherwise the layers are balanced by cost: one transformer block costs 1,
    the first stage also pays `embedding_weight` and the last `head_weight` (the output head is a
    vocab x dim matmul plus the loss; for a large vocabulary it is worth several blocks). The split
    minimizes the most expensive stage (the pipeline runs at the pace of its slowest stage) and, among
    those, the sum of squared stage costs (spread the remaining slack evenly). Every stage gets at
    least one block.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} layers (one per stage), "
                         f"the model has {num_layers}")
    if layers_per_stage is not None:
        counts = [int(c) for c in layers_per_stage]
        if len(counts) != num_stages:
            raise ValueError(f"layers_per_stage has {len(counts)} entries but there are {num_stages} stages "
                             f"(pp x virtual_stages): give one count per stage")
        if any(c < 1 for c in counts):
            raise ValueError(f"layers_per_stage={counts}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}, but the model has {num_layers} "
                             f"layers: the counts must add up to model.n_layers")
    else:
        if embedding_weight < 0 or head_weight < 0:
            raise ValueError(f"embedding_weight and head_weight must be >= 0, got {embedding_weight} and "
                             f"{head_weight}")
        counts = _balanced_counts(num_layers, num_stages, float(embedding_weight), float(head_weight))
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _balanced_counts(num_layers: int, num_stages: int, embedding_weight: float, head_weight: float) -> list[int]:
    """Exact two-pass dynamic program over contiguous splits (S x L^2, microseconds for real sizes)."""

    def cost(stage: int, count: int) -> float:
        extra = (embedding_weight if stage == 0 else 0.0) + (head_weight if stage == num_stages - 1 else 0.0)
        return count + extra

    def splits(score: Callable[[float], float], combine: Callable[[float, float], float],
               cap: float) -> tuple[float, list[int]]:
        # best[s][n]: best score of the first s stages holding the first n layers
        inf = math.inf
        best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
        choice = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, num_stages + 1):
            for n in range(s, num_layers - (num_stages - s) + 1):  # leave >= 1 layer per later stage
                for count in range(1, n - (s - 1) + 1):
                    prev = best[s - 1][n - count]
                    c = cost(s - 1, count)
                    if prev == inf or c > cap + 1e-9:
                        continue
                    value = combine(prev, score(c))
                    if value < best[s][n] - 1e-12:
                        best[s][n], choice[s][n] = value, count
        counts, n = [], num_layers
        for s in range(num_stages, 0, -1):
            counts.append(choice[s][n])
            n -= choice[s][n]
        return best[num_stages][num_layers], counts[::-1]

    bottleneck, _ = splits(lambda c: c, max, math.inf)
    _, counts = splits(lambda c: c * c, lambda a, b: a + b, bottleneck)
    return counts


# Schedules whose stages are placed in a V: rank r holds stage r (going down) and stage 2P - 1 - r (coming
# back up), so rank 0 holds the first and the last stage (torch's generate_stage_to_rank_mapping, style="v").
V_SCHEDULES = ("zbv", "dualpipev")


def stage_indices_of_rank(pp_rank: int, pp_size: int, virtual_stages: int, v_shape: bool = False) -> list[int]:
    """Stages held by `pp_rank`, in increasing order: the looped placement r, r + P, r + 2P, ..., or with
    `v_shape` (exactly 2 stages per rank) the V placement r, 2P - 1 - r."""
    if not v_shape:
        return [pp_rank + v * pp_size for v in range(virtual_stages)]
    if virtual_stages != 2:
        raise ValueError(f"the V placement holds exactly 2 stages per rank, got virtual_stages={virtual_stages}")
    return [pp_rank, 2 * pp_size - 1 - pp_rank]


def last_stage_rank(pp_size: int, virtual_stages: int, v_shape: bool = False) -> int:
    """The pp rank holding the last stage (the loss): (PV - 1) mod P looped, rank 0 in a V."""
    return 0 if v_shape else (pp_size * virtual_stages - 1) % pp_size


def split_model(model: nn.Module, ranges: Sequence[range], stage_indices: Sequence[int]) -> list[nn.Module]:
    """Copies of `model` (meta or materialized) holding only the given stages' layers.

    Stage `s` keeps the blocks `ranges[s]` (ModuleDict keys unchanged), the first-stage modules only if
    `s == 0` (or, for those the family names in `end_stage_copies`, if `s` is the last stage too) and the
    last-stage modules only if `s == len(ranges) - 1`; everything else is None. The copy skips the dropped
    modules, so a rank never holds more than its stages' weights (beyond the model it was given).
    Parameters shared by kept modules stay shared within a stage (a tied head on a stage that also holds
    the embedding); across stages they become separate copies (`pipeline_tied.TiedWeights` keeps the
    first and the last stage's equal). Each stage's `pp_stage_index` says which stage it is.
    """
    num_stages = len(ranges)
    family = family_of(model)
    layers = family.blocks(model)
    covered = sorted(i for r in ranges for i in r)
    if covered != list(range(len(layers))):
        raise ValueError(f"the stage ranges cover layers {covered}, not exactly the model's {len(layers)} layers")
    first_only, last_only = family.stage_only_modules(model)
    copies = set(family.end_stage_copies(model))  # first-stage modules the last stage holds a copy of

    def held(name: str, stage: int) -> bool:
        last = stage == num_stages - 1
        if name in first_only:
            return stage == 0 or (last and name in copies)
        return last

    stages = []
    for stage in stage_indices:
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage index {stage} is out of range for {num_stages} stages")
        keep = {str(i) for i in ranges[stage]}
        dropped = [m for key, m in layers.items() if key not in keep]
        dropped += [getattr(model, name) for name in first_only + last_only if not held(name, stage)]
        # deepcopy consults its memo before copying: mapping a module to None makes the copy hold None
        # in its place without ever copying that module's weights.
        memo: dict[int, Any] = {id(m): None for m in dropped if m is not None}
        part = copy.deepcopy(model, memo)
        for key in [k for k, m in family.blocks(part).items() if m is None]:
            family.set_block(part, key, None)
        for name in first_only + last_only:
            if not held(name, stage):
                setattr(part, name, None)
        part.pp_stage_index = stage  # read by materialize (per-stage init seed) and the tests
        stages.append(part)
    return stages
