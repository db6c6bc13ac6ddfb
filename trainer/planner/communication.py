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
  forward and backward (zero3), and gradients reduce-scattered; with grad_sync=step, or under a pipeline
  schedule, the reduce-scatter runs once per step, and with reshard_after_backward=false the forwards after
  the first one gather nothing; under a pipeline schedule each unit's gathers follow the order torch runs
  the rank's actions in (fsdp_gathers.py: a backward leaves its units gathered until a forward reshards
  them); hybrid sharding adds an all-reduce of the shards across replicas;
- tp (Megatron layout, per layer and micro-batch): two all-reduces in the forward and two in the
  backward of an activation (s x b x h), or with sequence parallelism the same bytes as all-gathers and
  reduce-scatters; recomputed blocks communicate their forward again;
- pp: each micro-batch's activation sent forward and its gradient backward at every stage boundary;
- cp (per layer and micro-batch, s/cp tokens per rank): ring attention sends its K/V block cp - 1 times
  in the forward, again in the backward together with cp hops of the fp32 K/V gradients (which travel
  back to their owner); all_to_all (Ulysses) exchanges q, k, v and the output in the forward and their
  gradients in the backward, each all-to-all moving (cp-1)/cp of the rank's tensor. Recomputed blocks
  (and the attention core under `attention` checkpointing) communicate their forward again, and the last
  stage's multi-token-prediction blocks (DeepSeek-V3) theirs. Keys and values of MLA have widths of their
  own (`head_dim`, `value_dim`). Gradients of the weights are averaged over dp x cp (the dp groups above
  include the cp ranks).
- Muon (`optimizer=muon`, per step): each hidden matrix is orthogonalised whole by one owner rank, so its
  update's shards are all-gathered over the ranks that split it and the result reduce-scattered back (the
  owner's result, zeros elsewhere): over dp for the sharded flavours, over tp for tensor-parallel splits;
  under ddp only the all-reduce that hands the owner's result to the replicas. One collective of each kind
  per matrix (a MoE layer's experts: one per tensor).
- ep (per MoE layer and micro-batch): the top_k copies of each of this rank's tokens go to their experts'
  ranks and come back (two all-to-alls in the forward, two in the backward, again for a recomputed block),
  each moving (ep-1)/ep of tokens x top_k x dim activations (uniform routing); expert gradients are
  reduced over the edp = dp x cp / ep ranks holding the same experts (in the dp collectives above, which
  count them at full size: an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.planner.fsdp_gathers import pipeline_gathers
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import V_SCHEDULES, Layout
from trainer.planner.memory import RankCoords, is_hidden_matrix, rank_hidden_numel, rank_numel, rank_part, rank_param_specs
from trainer.planner.params import ModelInventory

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, P2P = "all-reduce", "all-gather", "reduce-scatter", "point-to-point"
ALL_TO_ALL = "all-to-all"


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
        factor = {ALL_REDUCE: 2 * (n - 1) / n, ALL_GATHER: (n - 1) / n, REDUCE_SCATTER: (n - 1) / n, P2P: 1.0,
                  ALL_TO_ALL: (n - 1) / n}[self.op]
        hops = {ALL_REDUCE: 2 * (n - 1), ALL_GATHER: n - 1, REDUCE_SCATTER: n - 1, P2P: 1, ALL_TO_ALL: n - 1}[self.op]
        self.sent_bytes = factor * self.payload_bytes
        self.time_s = (self.sent_bytes / hardware.group_bandwidth(self.spans_nodes, self.op)
                       + self.count * hops * hardware.group_latency(self.spans_nodes, self.op))
        return self


def spans_nodes(layout: Layout, dimension: str, devices_per_node: int) -> bool:
    """Whether the groups of a mesh dimension cross node boundaries (mesh order pp, dp_replicate, dp_shard, cp,
    tp)."""
    order = [("pp", layout.pp), ("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard),
             ("cp", layout.cp), ("tp", layout.tp)]
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
    replicas = layout.replica_group  # dp_replicate x cp
    if (flavour in ("ddp", "zero1") and replicas > 1) or (flavour == "none" and layout.cp > 1):
        # (tp and pp alone average the gradients over the cp ranks with one all-reduce, as ddp does)
        grad_bytes = {"fp16": 2, "bf16": 2}.get(layout.comm_hook, layout.param_bytes)
        payload = full * grad_bytes * (0.01 if layout.comm_hook == "powersgd" else 1.0)
        buckets = max(1, math.ceil(payload / (layout.bucket_cap_mb * 2**20)))
        span = _spans(layout, ("dp_replicate", "cp"), gpn)
        out.append(Collective("dp", ALL_REDUCE, buckets, replicas, payload, span))
        if flavour == "zero1":
            out.append(Collective("dp", ALL_GATHER, 1, replicas, full * layout.param_bytes, span))
    elif flavour == "zero2" and replicas > 1:
        payload = full * layout.reduce_bytes
        buckets = max(1, math.ceil(payload / (layout.bucket_cap_mb * 2**20)))
        span = _spans(layout, ("dp_replicate", "cp"), gpn)
        out.append(Collective("dp", REDUCE_SCATTER, buckets, replicas, payload, span))
        out.append(Collective("dp", ALL_GATHER, 1, replicas, full * layout.param_bytes, span))
    elif layout.fsdp:
        span = _spans(layout, ("dp_shard", "cp"), gpn)
        if layout.pp > 1:
            # the units' gathers as torch's schedule runs them (fsdp_gathers.py): a unit a backward gathered
            # stays gathered until a forward reshards it
            gather_count, gathered, units = pipeline_gathers(inv, layout, coords)
        else:
            units = part.layers + 1  # one fully_shard unit per block, plus the root
            # gathers per unit and step: forward and (zero3) backward of every micro-batch, less the forwards
            # that find the parameters still gathered from the previous micro-batch's backward
            gathers = (2 if layout.reshard_after_forward else 1) * m
            if not layout.reshard_after_backward:
                gathers -= m - 1
            gather_count, gathered = gathers * units, gathers * full
        reductions = 1 if layout.grad_sync == "step" or layout.pp > 1 else m
        shards = layout.shard_group  # dp_shard x cp
        out.append(Collective("dp", ALL_GATHER, gather_count, shards, gathered * layout.unsharded_param_bytes, span))
        out.append(Collective("dp", REDUCE_SCATTER, units * reductions, shards,
                              reductions * full * layout.reduce_bytes, span))
        if layout.dp_replicate > 1:
            out.append(Collective("dp", ALL_REDUCE, units * reductions, layout.dp_replicate,
                                  reductions * shard * layout.reduce_bytes, spans_nodes(layout, "dp_replicate", gpn)))
    if layout.hidden_matrix_states is not None:
        out += muon_collectives(inv, layout, coords, gpn)
    if layout.cp > 1:
        out += context_parallel_collectives(inv, layout, coords, gpn)
    if layout.ep > 1 and inv.n_experts:
        out += expert_parallel_collectives(inv, layout, coords, gpn)
    if layout.tp > 1:
        activation = layout.local_seq_len * layout.micro_batch_size * inv.dim * layout.compute_bytes
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
        activation = layout.local_seq_len * layout.micro_batch_size * inv.dim * layout.compute_bytes
        sends = pipeline_sends(layout, coords.pp)
        out.append(Collective("pp", P2P, sends, 2, sends * activation, spans_nodes(layout, "pp", gpn)))
    return [c.timed(hardware) for c in out]


def pipeline_sends(layout: Layout, pp_rank: int) -> int:
    """Activations and gradients `pp_rank` sends to another rank per step: one per micro-batch across each
    boundary of its stages with a neighbour on another rank (forward the activation, backward the
    gradient)."""
    stages = layout.stages_of_rank(pp_rank)
    last = layout.pp * (2 if layout.schedule in V_SCHEDULES else layout.virtual_stages) - 1
    boundaries = 2 * len(stages) - (0 in stages) - (last in stages)
    if layout.schedule in V_SCHEDULES and pp_rank == layout.pp - 1:
        boundaries -= 2  # the V's turn: stages P - 1 and P on the same rank hand over locally
    return layout.num_microbatches * max(boundaries, 0)


def muon_collectives(inv: ModelInventory, layout: Layout, coords: RankCoords, devices_per_node: int) -> list[Collective]:
    """Muon's traffic at the optimizer step (see the module docstring): whole hidden matrices gathered to
    their owners and the owners' results handed back."""
    out: list[Collective] = []
    hidden, _ = rank_hidden_numel(inv, layout, coords)  # this rank's model-parallel part of them
    matrices = sum(copies for spec, copies in rank_param_specs(inv, layout, coords.pp) if is_hidden_matrix(inv, spec))
    if not matrices:
        return out
    flavour = layout.dp_flavour
    payload = hidden * layout.param_bytes
    if flavour in ("zero1", "zero2") and layout.replica_group > 1:
        group, span = layout.replica_group, _spans(layout, ("dp_replicate", "cp"), devices_per_node)
    elif layout.fsdp and layout.shard_group > 1:
        group, span = layout.shard_group, _spans(layout, ("dp_shard", "cp"), devices_per_node)
    else:
        group, span = 0, False
    if group:
        out.append(Collective("dp", ALL_GATHER, matrices, group, payload, span))
        out.append(Collective("dp", REDUCE_SCATTER, matrices, group, payload, span))
    elif flavour == "ddp" and layout.replica_group > 1:
        out.append(Collective("dp", ALL_REDUCE, matrices, layout.replica_group, payload,
                              _spans(layout, ("dp_replicate", "cp"), devices_per_node)))
    if layout.tp > 1:
        whole = payload * layout.tp  # the tp ranks' shards of each matrix together
        span = spans_nodes(layout, "tp", devices_per_node)
        out.append(Collective("tp", ALL_GATHER, matrices, layout.tp, whole, span))
        out.append(Collective("tp", REDUCE_SCATTER, matrices, layout.tp, whole, span))
    return out


def _spans(layout: Layout, dimensions: tuple[str, ...], devices_per_node: int) -> bool:
    """Whether a group joining several mesh dimensions crosses nodes (its outermost dimension in use does)."""
    return any(spans_nodes(layout, d, devices_per_node) for d in dimensions if getattr(layout, d) > 1)


def expert_parallel_collectives(inv: ModelInventory, layout: Layout, coords: RankCoords,
                                devices_per_node: int) -> list[Collective]:
    """The token dispatch and combine of expert parallelism for one rank and step (module docstring)."""
    from trainer.planner.activations import checkpointed_layers

    part = rank_part(inv, layout, coords.pp)
    passes = layout.num_microbatches * (2 * part.layers + checkpointed_layers(layout, inv, coords.pp))
    rows = layout.local_seq_len * layout.micro_batch_size * inv.top_k  # token copies this rank routes
    payload = rows * inv.dim * layout.compute_bytes
    # ep groups are ep consecutive ranks of dp x cp (stride tp): they cross nodes when ep x cp x tp... exceeds a node
    span = layout.ep * layout.cp * layout.tp > devices_per_node
    return [Collective("ep", ALL_TO_ALL, 2 * passes, layout.ep, 2 * passes * payload, span)]


def context_parallel_collectives(inv: ModelInventory, layout: Layout, coords: RankCoords,
                                 devices_per_node: int) -> list[Collective]:
    """The attention traffic of context parallelism for one rank and step (see the module docstring)."""
    from trainer.models.context_parallel import kv_head_repeat
    from trainer.planner.activations import checkpointed_layers

    cp, tp, m = layout.cp, layout.tp, layout.num_microbatches
    part = rank_part(inv, layout, coords.pp)
    forwards = part.layers + checkpointed_layers(layout, inv, coords.pp)  # recomputed blocks run theirs again
    if layout.checkpointing == "attention":
        forwards += part.layers
    mtp = inv.mtp_blocks if part.last else 0  # DeepSeek-V3's MTP blocks (not checkpointed) attend across cp too
    forwards, backwards = forwards + mtp, part.layers + mtp
    tokens = layout.local_seq_len * layout.micro_batch_size
    # per token: the queries' and the keys' width (n_heads x head_dim), the values' and the output's (x value_dim)
    qk_v = inv.head_dim + inv.value_dim
    q_width, kv_width = inv.n_heads * qk_v / tp, inv.n_kv_heads * qk_v / tp
    span = spans_nodes(layout, "cp", devices_per_node)
    if layout.cp_method == "ring":
        block = tokens * kv_width * layout.compute_bytes  # this rank's K and V
        kv_hops = m * (cp - 1) * (forwards + backwards)  # forward(s), and the backward's pass of the ring
        grad_hops = m * cp * backwards  # fp32 dK, dV travel home
        return [Collective("cp", P2P, kv_hops, cp, kv_hops * block, span),
                Collective("cp", P2P, grad_hops, cp, grad_hops * tokens * kv_width * 4, span)]
    repeat = kv_head_repeat(inv.n_heads // tp, inv.n_kv_heads // tp, cp)
    exchanged = tokens * (q_width + kv_width * repeat) * layout.compute_bytes  # q, k, v in; output back
    passes = m * (forwards + backwards)
    return [Collective("cp", ALL_TO_ALL, 4 * passes, cp, passes * exchanged, span)]
