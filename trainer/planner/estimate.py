"""Estimates of one layout: each pipeline position's rank (memory, time) and whether they fit the
hardware. Shared by `plan` (trainer/planner/core.py) and the search (trainer/planner/search.py)."""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig

from trainer.planner.activations import ActivationEstimate, estimate_activations
from trainer.planner.communication import Collective, step_collectives
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout
from trainer.planner.memory import GB, RankCoords, rank_numel, rank_part, rank_state_bytes
from trainer.planner.params import ModelInventory
from trainer.planner.timing import Timing, estimate_time


# Sizes the JSON line reports under memory_gb, in this order.
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
    temporaries: dict[str, float]  # named transient buffers at the forward/backward peak
    step_temporaries: dict[str, float]  # named transient buffers during the optimizer step
    device: dict[str, float]  # device-resident bytes: params, grads, optimizer, activations, temporaries, total
    host: float  # host-resident bytes of this rank (offloaded states and activations)
    collectives: list[Collective]
    timing: Timing


def temporaries(inv: ModelInventory, layout: Layout, coords: RankCoords,
                acts: ActivationEstimate) -> tuple[dict[str, float], dict[str, float]]:
    """Transient buffers at the forward/backward peak and during the optimizer step (bytes)."""
    full, shard = rank_numel(inv, layout, coords)
    part = rank_part(inv, layout, coords.pp)
    fb: dict[str, float] = {}
    if acts.recompute_transient:
        fb["recomputed block"] = acts.recompute_transient
    if acts.logits_transient:
        fb["logits and their gradient"] = acts.logits_transient
    if layout.fsdp:
        # (a rank holds 1/ep of each MoE layer's experts, whole under tp: tp splits only weights with a tp_dim)
        layer_numel = sum(math.prod(p.local_shape(layout.tp)) / (layout.ep if p.expert else 1) for p in inv.layer)
        root = full - part.layers * layer_numel
        accumulating = layout.num_microbatches > 1
        if layout.reshard_after_forward and not (accumulating and (not layout.reshard_after_backward or layout.pp > 1)):
            gathered = (1 + layout.prefetch_blocks) * layer_numel + root
        else:  # shard_grad_op, or blocks kept gathered from one micro-batch's backward to the next forward
            gathered = full
        fb["gathered parameters"] = gathered * layout.unsharded_param_bytes
        # a block's gradients are computed unsharded (compute dtype), then cast for the reduce-scatter
        grads = layer_numel if part.layers else root
        fb["unsharded gradients of a block"] = grads * (layout.unsharded_param_bytes + layout.reduce_bytes)
        if accumulating and (layout.grad_sync == "step" or layout.pp > 1):
            # the reduction waits for the last micro-batch: every unit's gradient accumulates unsharded
            fb["unsharded gradients accumulated over micro-batches"] = (full - grads) * layout.reduce_bytes
    elif layout.strategy == "3d" and layout.replica_group > 1:
        # torch's `replicate` (3d's ddp/zero1 flavours) gathers each block's compute copy (FSDP2's machinery,
        # a world of one shard) and keeps it from the forward to the end of the backward
        fb["replicated parameters gathered for compute"] = full * layout.unsharded_param_bytes
    elif layout.autocast:
        # autocast's cast of every weight is saved by its matmul for the backward; each pipeline forward
        # runs in its own autocast region, so every in-flight micro-batch holds its own copy
        copies = acts.in_flight if layout.pp > 1 else 1.0
        fb["autocast weight copies"] = full * layout.compute_bytes * copies
    step: dict[str, float] = {}
    optimizer_numel = full if layout.dp_flavour in ("none", "ddp") else shard
    if layout.optimizer_states:
        # foreach AdamW/SGD builds intermediates the size of the moments (e.g. sqrt of exp_avg_sq)
        step["optimizer intermediates"] = optimizer_numel * layout.optimizer_state_bytes
    if layout.dp_flavour == "zero2" and layout.replica_group > 1:
        # the whole local gradient lives until the reduce-scatter (the state counts only this rank's
        # rows), plus one bucket's send buffer and its received rows
        bucket = min(full, layout.bucket_cap_mb * 2**20 / layout.reduce_bytes)
        fb["local gradients before the reduce-scatter"] = (full - shard) * layout.param_bytes + (
            bucket * (1 + 1 / layout.replica_group)) * layout.reduce_bytes
    if layout.dp_flavour in ("zero1", "zero2"):
        # one bucket at a time: the gathered rows of at most bucket_cap_mb (a larger tensor is a bucket
        # of its own) and this rank's part of them
        largest = max(math.prod(spec.local_shape(layout.tp)) for spec in (*inv.embedding, *inv.layer, *inv.head))
        bucket = min(full, max(layout.bucket_cap_mb * 2**20 / layout.param_bytes, largest))
        step["ZeRO all-gather buffers"] = bucket * (1 + 1 / layout.replica_group) * layout.param_bytes
    return fb, step


def estimate_rank(inv: ModelInventory, layout: Layout, hardware: HardwareConfig, coords: RankCoords,
                  options: PlanOptions) -> RankEstimate:
    state = rank_state_bytes(inv, layout, coords)
    acts = estimate_activations(inv, layout, coords.pp, hardware.device_type)
    fb, step = temporaries(inv, layout, coords, acts)
    offloaded = layout.offload and hardware.device_type != "cpu"
    optimizer_offloaded = layout.offload_optimizer and not offloaded and hardware.device_type != "cpu"
    device_state = {k: (0.0 if offloaded or (optimizer_offloaded and k == "optimizer") else v)
                    for k, v in state.items()}
    host = sum(state.values()) - sum(device_state.values()) + acts.host
    if offloaded or optimizer_offloaded:
        step = {}  # the optimizer steps on the host
    device_temporaries = max(acts.device + sum(fb.values()), sum(step.values())) - acts.device
    device = {**device_state, "activations": acts.device, "temporaries": device_temporaries}
    device["total"] = sum(device.values())
    collectives = step_collectives(inv, layout, coords, hardware)
    timing = estimate_time(inv, layout, coords, hardware, collectives, options.matmul_efficiency,
                           options.attention_efficiency)
    return RankEstimate(rank=coords.rank(layout), coords=coords, state=state, activations=acts, temporaries=fb,
                        step_temporaries=step, device=device, host=host, collectives=collectives, timing=timing)


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
