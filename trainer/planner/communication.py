"""Communication per optimizer step for each parallel dimension, and its time over the configured links.

Volumes are what one rank sends with ring algorithms (payload X bytes, n ranks): all-reduce 2(n-1)/n X,
all-gather and reduce-scatter (n-1)/n X each, point-to-point X. A group uses the inter-node bandwidth as
soon as it spans nodes; the mesh is laid out pp x dp_replicate x dp_shard x tp (tp innermost), so a
dimension's group spans nodes when its stride times its size exceeds the devices per node.

What each strategy of this trainer communicates (M micro-batches per step):
- ddp: one gradient all-reduce per step (no_sync on the other micro-batches), in DDP buckets;
- zero1: the same all-reduce plus an all-gather of the updated parameter rows after the step;
- zero2: one reduce-scatter of the accumulated gradients per step (in buckets), then the all-gather of
  the updated rows: the bytes of one all-reduce in all;
- shard_grad_op / zero3 (FSDP2): per micro-batch, parameters all-gathered once (shard_grad_op) or twice,
  forward and backward (zero3), and gradients reduce-scattered (FSDP2 reduces every backward: the strategy
  does not defer the reduction to the last micro-batch); hybrid sharding adds an all-reduce of the shards
  across replicas;
- tp (Megatron layout, per layer and micro-batch): two all-reduces in the forward and two in the
  backward of an activation (s x b x h), or with sequence parallelism the same bytes as all-gathers and
  reduce-scatters; recomputed blocks communicate their forward again;
- pp: each micro-batch's activation sent forward and its gradient backward at every stage boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout
from trainer.planner.memory import RankCoords, rank_numel, rank_part
from trainer.planner.params import ModelInventory

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, P2P = "all-reduce", "all-gather", "reduce-scatter", "point-to-point"


@dataclass
class Collective:
    """Traffic of one kind on one parallel dimension, per optimizer step and rank."""

    dimension: str  # dp, tp, pp
    op: str
    count: int  # collectives per step
    group_size: int
    payload_bytes: float  # summed payload (the full tensors) per step
    spans_nodes: bool
    # Filled by `timed`: bytes this rank sends and the time over the link.
    sent_bytes: float = 0.0
    time_s: float = 0.0

    def timed(self, hardware: HardwareConfig) -> Collective:
        n = self.group_size
        factor = {ALL_REDUCE: 2 * (n - 1) / n, ALL_GATHER: (n - 1) / n, REDUCE_SCATTER: (n - 1) / n, P2P: 1.0}[self.op]
        hops = {ALL_REDUCE: 2 * (n - 1), ALL_GATHER: n - 1, REDUCE_SCATTER: n - 1, P2P: 1}[self.op]
        self.sent_bytes = factor * self.payload_bytes
        self.time_s = (self.sent_bytes / hardware.group_bandwidth(self.spans_nodes)
                       + self.count * hops * hardware.group_latency(self.spans_nodes))
        return self


def spans_nodes(layout: Layout, dimension: str, devices_per_node: int) -> bool:
    """Whether the groups of a mesh dimension cross node boundaries (mesh order pp, dp_replicate, dp_shard, tp)."""
    order = [("pp", layout.pp), ("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard), ("tp", layout.tp)]
    stride = 1
    for name, size in reversed(order):
        if name == dimension:
            return stride * size > devices_per_node
        stride *= size
    raise ValueError(f"unknown mesh dimension {dimension!r}")


def step_collectives(inv: ModelInventory, layout: Layout, coords: RankCoords,
                     hardware: HardwareConfig) -> list[Collective]:
    """Every kind of traffic of one rank during one optimizer step, timed."""
    out: list[Collective] = []
    m = layout.num_microbatches
    full, shard = rank_numel(inv, layout, coords)
    part = rank_part(inv, layout, coords.pp)
    gpn = hardware.devices_per_node
    flavour = layout.dp_flavour
    if flavour in ("ddp", "zero1") and layout.dp_replicate > 1:
        grad_bytes = {"fp16": 2, "bf16": 2}.get(layout.comm_hook, layout.param_bytes)
        payload = full * grad_bytes * (0.01 if layout.comm_hook == "powersgd" else 1.0)
        buckets = max(1, math.ceil(payload / (layout.bucket_cap_mb * 2**20)))
        span = spans_nodes(layout, "dp_replicate", gpn)
        out.append(Collective("dp", ALL_REDUCE, buckets, layout.dp_replicate, payload, span))
        if flavour == "zero1":
            out.append(Collective("dp", ALL_GATHER, 1, layout.dp_replicate, full * layout.param_bytes, span))
    elif flavour == "zero2" and layout.dp_replicate > 1:
        payload = full * layout.reduce_bytes
        buckets = max(1, math.ceil(payload / (layout.bucket_cap_mb * 2**20)))
        span = spans_nodes(layout, "dp_replicate", gpn)
        out.append(Collective("dp", REDUCE_SCATTER, buckets, layout.dp_replicate, payload, span))
        out.append(Collective("dp", ALL_GATHER, 1, layout.dp_replicate, full * layout.param_bytes, span))
    elif layout.fsdp:
        units = part.layers + 1  # one fully_shard unit per block, plus the root
        span = spans_nodes(layout, "dp_shard", gpn)
        gathers = 2 if layout.reshard_after_forward else 1
        out.append(Collective("dp", ALL_GATHER, gathers * units * m, layout.dp_shard,
                              gathers * m * full * layout.unsharded_param_bytes, span))
        out.append(Collective("dp", REDUCE_SCATTER, units * m, layout.dp_shard, m * full * layout.reduce_bytes, span))
        if layout.dp_replicate > 1:
            out.append(Collective("dp", ALL_REDUCE, units * m, layout.dp_replicate, m * shard * layout.reduce_bytes,
                                  spans_nodes(layout, "dp_replicate", gpn)))
    if layout.tp > 1:
        activation = layout.seq_len * layout.micro_batch_size * inv.dim * layout.compute_bytes
        per_layer = 4  # forward and backward: two all-reduces each (or their all-gather/reduce-scatter halves)
        from trainer.planner.activations import checkpointed_layers

        recomputed = checkpointed_layers(layout, inv, coords.pp) * 2  # the forward's two again
        ends = (1 if part.first else 0) + (1 if part.last else 0)  # vocab-parallel embedding, head input
        count = m * (per_layer * part.layers + recomputed + 2 * ends)
        span = spans_nodes(layout, "tp", gpn)
        if layout.sequence_parallel:
            # each all-reduce becomes an all-gather + a reduce-scatter of the same payload; selective
            # recomputation does not keep the two gathered inputs of a layer: gathered again
            gathers = count + (m * 2 * part.layers if layout.checkpointing == "selective" else 0)
            out.append(Collective("tp", ALL_GATHER, gathers, layout.tp, gathers * activation, span))
            out.append(Collective("tp", REDUCE_SCATTER, count, layout.tp, count * activation, span))
        else:
            out.append(Collective("tp", ALL_REDUCE, count, layout.tp, count * activation, span))
    if layout.pp > 1:
        activation = layout.seq_len * layout.micro_batch_size * inv.dim * layout.compute_bytes
        boundaries = 2 * layout.virtual_stages - (1 if part.first else 0) - (1 if part.last else 0)
        sends = m * max(boundaries, 0)
        out.append(Collective("pp", P2P, sends, 2, sends * activation, spans_nodes(layout, "pp", gpn)))
    return [c.timed(hardware) for c in out]
