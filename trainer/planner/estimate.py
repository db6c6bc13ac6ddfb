"""Estimates of one layout: each pipeline position's rank (memory, time) and whether they fit the
hardware. Shared by `plan` (trainer/planner/core.py) and the search (trainer/planner/search.py)."""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from trainer.planner.activations import ActivationEstimate, estimate_activations
from trainer.planner.communication import Collective, step_collectives
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout
from trainer.planner.memory import GB, RankCoords, rank_numel, rank_part, rank_state_bytes
from trainer.planner.params import ModelInventory
from trainer.planner.phases import Transients, step_phases
from trainer.planner.timing import Timing, estimate_time


# Sizes the JSON line reports under memory_gb, in this order: the model states the rank holds, what its
# forward saves, the temporaries of its peak phase, and the peak (trainer/planner/phases.py: the largest
# phase of a step, which holds of the gradients only those present then; not the sum of the others).
MEMORY_FIELDS = ("params", "grads", "optimizer", "activations", "temporaries", "total")


@dataclass
class PlanOptions:
    """The `plan.*` options the estimate itself depends on (the rest concern the report)."""

    headroom: float = 0.1
    matmul_efficiency: float = 0.6
    rank: Optional[int] = None
    attention_efficiency: Optional[float] = None  # None: matmul_efficiency

    @staticmethod
    def of(cfg: DictConfig) -> PlanOptions:
        node = cfg.get("plan", None)
        if node is None:
            return PlanOptions()
        attention = node.get("attention_efficiency", None)
        return PlanOptions(headroom=float(node.headroom), matmul_efficiency=float(node.matmul_efficiency),
                           attention_efficiency=None if attention is None else float(attention),
                           rank=node.rank)


@dataclass
class RankEstimate:
    """Everything estimated for one rank."""

    rank: int
    coords: RankCoords
    state: dict[str, float]  # params, grads, optimizer bytes this rank holds (device or host)
    activations: ActivationEstimate
    temporaries: dict[str, float]  # named transient buffers of the peak phase
    step_temporaries: dict[str, float]  # named transient buffers during the optimizer step
    # device bytes: params, grads, optimizer (held), activations (saved by the forward), temporaries (of the
    # peak phase), total (the peak phase's: not the sum of the others, see trainer/planner/phases.py)
    device: dict[str, float]
    host: float  # host-resident bytes of this rank (offloaded states and activations)
    collectives: list[Collective]
    timing: Timing
    # {phase: {params, grads, optimizer, activations, temporaries, total}}: what exists at each phase
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    peak_phase: str = ""  # the phase whose total is `device["total"]`
    phase_temporaries: dict[str, dict[str, float]] = field(default_factory=dict)


def temporaries(inv: ModelInventory, layout: Layout, coords: RankCoords) -> Transients:
    """Buffers besides the model states and the saved activations, by when they exist (bytes). The
    activations' own transients (the logits, the loss's gradients, a recomputed block, autocast's weight
    casts) come from `estimate_activations`; which gradients exist when, from `phases.gradient_presence`."""
    full, shard = rank_numel(inv, layout, coords)
    part = rank_part(inv, layout, coords.pp)
    out = Transients()
    if layout.fsdp:
        # (a rank holds 1/ep of each MoE layer's experts, whole under tp: tp splits only weights with a tp_dim)
        layer_numel = sum(math.prod(p.local_shape(layout.tp)) / (layout.ep if p.expert else 1) for p in inv.layer)
        root = full - part.layers * layer_numel
        accumulating = layout.num_microbatches > 1
        if layout.reshard_after_forward and not (accumulating and (not layout.reshard_after_backward or layout.pp > 1)):
            gathered = (1 + layout.prefetch_blocks) * layer_numel + root
        else:  # shard_grad_op, or blocks kept gathered from one micro-batch's backward to the next forward
            gathered = full
        out.gathered["gathered parameters"] = gathered * layout.unsharded_param_bytes
        # a block's gradients are computed unsharded (compute dtype), then cast for the reduce-scatter
        grads = layer_numel if part.layers else root
        out.block_backward["unsharded gradients of a block"] = grads * (layout.unsharded_param_bytes
                                                                        + layout.reduce_bytes)
    elif layout.strategy == "3d" and layout.replica_group > 1:
        # torch's `replicate` (3d's ddp/zero1 flavours) gathers each block's compute copy (FSDP2's machinery,
        # a world of one shard) and keeps it from the forward to the end of the backward
        out.gathered["replicated parameters gathered for compute"] = full * layout.unsharded_param_bytes
    optimizer_numel = full if layout.dp_flavour in ("none", "ddp") else shard
    if layout.optimizer_states and not layout.optimizer_fused:
        # foreach AdamW/SGD builds intermediates the size of the moments (e.g. sqrt of exp_avg_sq); the fused
        # kernel updates in place
        out.step["optimizer intermediates"] = optimizer_numel * layout.optimizer_state_bytes
    if layout.master_bytes and not layout.offload_optimizer:
        # master copies on the device (trainer.optim.SteppedCopies): every gradient is copied to the masters'
        # dtype before the one optimizer call (offloaded copies go through host staging buffers instead)
        out.step["gradients in the masters' dtype"] = optimizer_numel * layout.master_bytes
    if layout.dp_flavour == "zero2" and layout.replica_group > 1:
        # the reduce-scatter of the whole local gradient (`phases.gradient_presence`), one bucket at a time:
        # its send buffer and its received rows
        bucket = min(full, layout.bucket_cap_mb * 2**20 / layout.reduce_bytes)
        out.reduction["reduce-scatter bucket"] = bucket * (1 + 1 / layout.replica_group) * layout.reduce_bytes
    if layout.dp_flavour in ("zero1", "zero2"):
        # one bucket at a time: the gathered rows of at most bucket_cap_mb (a larger tensor is a bucket
        # of its own) and this rank's part of them
        largest = max(math.prod(spec.local_shape(layout.tp)) for spec in (*inv.embedding, *inv.layer, *inv.head))
        bucket = min(full, max(layout.bucket_cap_mb * 2**20 / layout.param_bytes, largest))
        out.step["ZeRO all-gather buffers"] = bucket * (1 + 1 / layout.replica_group) * layout.param_bytes
    return out


def estimate_rank(inv: ModelInventory, layout: Layout, hardware: HardwareConfig, coords: RankCoords,
                  options: PlanOptions) -> RankEstimate:
    """One rank's estimate. Its device memory is the largest phase of a step (trainer/planner/phases.py):
    `device` reports the model states the rank holds (params, grads, optimizer), what its forward saves
    (activations), the temporaries of the peak phase, and that phase's total, which counts of the
    gradients only those present then."""
    state = rank_state_bytes(inv, layout, coords)
    acts = estimate_activations(inv, layout, coords.pp, hardware.device_type)
    transients = temporaries(inv, layout, coords)
    offloaded = layout.offload and hardware.device_type != "cpu"
    optimizer_offloaded = layout.offload_optimizer and not offloaded and hardware.device_type != "cpu"
    device_state = {k: (0.0 if offloaded or (optimizer_offloaded and k == "optimizer") else v)
                    for k, v in state.items()}
    host = sum(state.values()) - sum(device_state.values()) + acts.host
    if offloaded or optimizer_offloaded:
        transients.step = {}  # the optimizer steps on the host
    phases, named = step_phases(inv, layout, coords, acts, device_state, transients)
    peak = max(phases, key=lambda name: phases[name]["total"])  # the first of equals, in step order
    device = {**device_state, "activations": acts.device, "temporaries": phases[peak]["temporaries"],
              "total": phases[peak]["total"]}
    collectives = step_collectives(inv, layout, coords, hardware)
    timing = estimate_time(inv, layout, coords, hardware, collectives, options.matmul_efficiency,
                           options.attention_efficiency)
    return RankEstimate(rank=coords.rank(layout), coords=coords, state=state, activations=acts,
                        temporaries=named[peak], step_temporaries=transients.step, device=device, host=host,
                        collectives=collectives, timing=timing, phases=phases, peak_phase=peak,
                        phase_temporaries=named)


def ranks_to_estimate(inv: ModelInventory, layout: Layout) -> list[RankCoords]:
    """The pipeline positions that can hold the most: the first (most micro-batches in flight, the
    embedding), the second (the most in flight among ranks without the embedding), the last (the head and
    its logits) and the one with the most layers. Data- and tensor-parallel peers hold the same, within
    the padding of uneven shards."""
    if layout.pp <= 4:
        return [RankCoords(pp=r) for r in range(layout.pp)]
    most = max(range(layout.pp), key=lambda r: rank_part(inv, layout, r).layers)
    return [RankCoords(pp=r) for r in sorted({0, 1, layout.pp - 1, most})]


def usable_bytes(hardware: HardwareConfig, headroom: float) -> float:
    """Device memory the estimate may fill: capacity less what is reserved, less the headroom."""
    return (hardware.memory_gb - hardware.reserved_gb) * GB * (1 - headroom)


def host_bytes_per_rank(hardware: HardwareConfig, headroom: float) -> float:
    return hardware.host_memory_gb * GB * (1 - headroom) / hardware.devices_per_node


@dataclass
class Suggestion:
    """A configuration the search found to fit and validated: the full override list that runs it."""

    overrides: list[str]  # the command line: the plan's own overrides, with the search's changes
    changes: list[str]  # what the search set (strategy, sizes, policy, micro-batch)
    description: str
    memory_gb: float  # device memory of its most loaded rank
    memory: dict[str, float]  # that rank's device bytes: MEMORY_FIELDS
    capacity_bytes: float
    tokens_per_s: float
    mfu: float
    step_time_s: float
    peak_phase: str = ""  # the phase of a step at which that rank peaks (trainer/planner/phases.py)
    at_peak: dict[str, float] = field(default_factory=dict)  # what exists then: MEMORY_FIELDS, summing to total

    @property
    def command(self) -> str:
        return " ".join(["python -m trainer", *self.overrides])


def evaluate(inv: ModelInventory, layout: Layout, hardware: HardwareConfig, options: PlanOptions) -> list[RankEstimate]:
    """Estimates of every pipeline position's rank (one rank without pipelining)."""
    return [estimate_rank(inv, layout, hardware, coords, options) for coords in ranks_to_estimate(inv, layout)]


def fits(estimates: list[RankEstimate], hardware: HardwareConfig, options: PlanOptions) -> tuple[bool, list[str]]:
    usable = usable_bytes(hardware, options.headroom)
    host_usable = host_bytes_per_rank(hardware, options.headroom)
    short = []
    worst = max(estimates, key=lambda e: e.device["total"])
    if worst.device["total"] > usable:
        short.append(f"device memory on rank {worst.rank}: needs {worst.device['total'] / GB:.2f} GB, "
                     f"{usable / GB:.2f} GB usable of {hardware.memory_gb:g} GB ({hardware.reserved_gb:g} GB "
                     f"reserved, {options.headroom:.0%} headroom): short by "
                     f"{(worst.device['total'] - usable) / GB:.2f} GB")
    host_worst = max(estimates, key=lambda e: e.host)
    if host_worst.host > host_usable:
        short.append(f"host memory for rank {host_worst.rank}: needs {host_worst.host / GB:.2f} GB, its share of the "
                     f"node's {hardware.host_memory_gb:g} GB is {host_usable / GB:.2f} GB usable")
    return not short, short
