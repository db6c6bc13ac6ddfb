"""Bytes of model state per rank: parameters, gradients and optimizer states, ZeRO-stage aware.

Convention (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3.1): with Psi parameters, mixed-precision Adam holds 2 Psi bytes of fp16 weights, 2 Psi of
fp16 gradients and K Psi of optimizer states (fp32 master weights, momentum and variance: K = 12), 16 bytes
per parameter. Stage 1 (P_os) divides the K Psi term by the data-parallel degree N_d, stage 2 (P_os+g) the
gradients too, stage 3 (P_os+g+p) everything. `ZERO_PAPER` and `ZERO_STAGES` state exactly that.

This trainer's number formats put the same 16 bytes elsewhere: fp32 and autocast mixed precision (bf16,
fp16) keep fp32 parameters, which are the master copy, fp32 gradients and fp32 Adam moments: 4 + 4 + 8.
`bytes_per_param(layout)` gives the split of a configured run. The sharding follows this trainer's
strategies (`flavour_sharding`): zero1 and zero2 are the paper's stages 1 and 2 (parameters replicated,
optimizer states and for zero2 gradients partitioned); zero3, hybrid_shard and FSDP2's shard_grad_op
keep parameters sharded at rest (shard_grad_op gathers them once per micro-batch and keeps them through
the backward: a temporary here).

These are the bytes a rank holds after a step. Within a step the gradients exist only from the backward
that makes them (between steps they are None), so the device peak is not their sum with the activations:
trainer/planner/phases.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trainer.planner.layout import Layout
from trainer.planner.params import ModelInventory, ParamSpec

GB = 1e9


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes each parameter costs in weights, gradients and optimizer states."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    def describe(self) -> str:
        return f"{self.weights:g} + {self.grads:g} + {self.optimizer:g} = {self.total:g} bytes/param"


# The ZeRO paper's mixed-precision Adam: fp16 weights and gradients, K = 12 bytes of fp32 optimizer state.
ZERO_PAPER = BytesPerParam(weights=2, grads=2, optimizer=12)


@dataclass(frozen=True)
class StateSharding:
    """Which of the three model states are partitioned over the data-parallel ranks."""

    params: bool
    grads: bool
    optimizer: bool


# The paper's stages: baseline data parallelism, P_os, P_os+g, P_os+g+p.
ZERO_STAGES = {
    0: StateSharding(False, False, False),
    1: StateSharding(False, False, True),
    2: StateSharding(False, True, True),
    3: StateSharding(True, True, True),
}


def flavour_sharding(flavour: str) -> StateSharding:
    """What this trainer's data-parallel flavours shard at rest (see the module docstring for ZeRO-2)."""
    if flavour in ("none", "ddp"):
        return ZERO_STAGES[0]
    if flavour == "zero1":
        return ZERO_STAGES[1]
    if flavour == "zero2":
        return ZERO_STAGES[2]
    return ZERO_STAGES[3]  # zero3, hybrid_shard, shard_grad_op: FSDP2 keeps parameters sharded between steps


def bytes_per_param(layout: Layout) -> BytesPerParam:
    """The split of a configured run: gradients live on the parameters (same dtype); the optimizer holds
    its moments in the parameter dtype plus any fp32 master copy the precision keeps, or, offloaded
    without one (ZeRO-Offload), the host copy of the parameters it steps."""
    copy = layout.master_bytes or (layout.param_bytes if layout.offload_optimizer else 0)
    return BytesPerParam(
        weights=layout.param_bytes,
        grads=layout.param_bytes,
        optimizer=layout.optimizer_states * layout.optimizer_state_bytes + copy,
    )


def describe_convention(layout: Layout) -> str:
    bpp = bytes_per_param(layout)
    return (f"bytes/param (weights + grads + optimizer) for {layout.precision} with "
            f"{layout.optimizer_states} optimizer state(s): {bpp.describe()}; ZeRO's mixed-precision Adam "
            f"convention (fp16 weights and grads, K=12 fp32 master+momentum+variance): {ZERO_PAPER.describe()}")


def model_state_bytes(full_numel: float, shard_numel: float, sharding: StateSharding,
                      bpp: BytesPerParam) -> dict[str, float]:
    """{params, grads, optimizer} bytes of one rank that holds `full_numel` elements of the model (its
    model-parallel part) and `shard_numel` of them as its data-parallel shard."""
    return {
        "params": bpp.weights * (shard_numel if sharding.params else full_numel),
        "grads": bpp.grads * (shard_numel if sharding.grads else full_numel),
        "optimizer": bpp.optimizer * (shard_numel if sharding.optimizer else full_numel),
    }


# ---- what one rank holds ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankCoords:
    """A rank's position in the mesh (pp, dp_replicate, dp_shard, cp, tp), outermost to innermost."""

    pp: int = 0
    dp_replicate: int = 0
    dp_shard: int = 0
    tp: int = 0
    cp: int = 0

    @staticmethod
    def of(rank: int, layout: Layout) -> RankCoords:
        sizes = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
        coords = []
        for size in reversed(sizes):
            coords.append(rank % size)
            rank //= size
        pp, rep, shard, cp, tp = reversed(coords)
        return RankCoords(pp=pp, dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp)

    def rank(self, layout: Layout) -> int:
        outer = (self.pp * layout.dp_replicate + self.dp_replicate) * layout.dp_shard + self.dp_shard
        return (outer * layout.cp + self.cp) * layout.tp + self.tp


def chunk_rows(rows: int, rank: int, world: int) -> int:
    """Rows of `rank`'s Shard(0) chunk (ceil-sized chunks, the last ones shorter or empty), as FSDP2 and
    this trainer's ZeRO-1 split a tensor."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


def stage_layers(inv: ModelInventory, layout: Layout) -> tuple[int, ...]:
    """Number of layers of every pipeline stage (one entry without pipelining), as the pipeline strategy's
    own balancing function places them."""
    return _stage_layers(inv.n_layers, layout.pp * layout.virtual_stages, layout.layers_per_stage,
                         layout.embedding_weight, layout.head_weight)


@functools.lru_cache(maxsize=4096)
def _stage_layers(n_layers: int, stages: int, layers_per_stage: tuple[int, ...] | None, embedding_weight: float,
                  head_weight: float) -> tuple[int, ...]:
    # cached: the balancing is a dynamic program over splits, and the search asks for the same few often
    from trainer.plugins.strategies.pipeline import stage_layer_ranges

    if stages == 1:
        return (n_layers,)
    ranges = stage_layer_ranges(n_layers, stages, layers_per_stage=layers_per_stage,
                                embedding_weight=embedding_weight, head_weight=head_weight)
    return tuple(len(r) for r in ranges)


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank computes: its layers, and whether it holds the embedding and the head."""

    layers: int
    first: bool
    last: bool
    # Layers of each of its (virtual) stages.
    stage_layers: tuple[int, ...]


def rank_part(inv: ModelInventory, layout: Layout, pp_rank: int) -> RankPart:
    return _rank_part(inv.n_layers, layout.pp, layout.virtual_stages, layout.layers_per_stage,
                      layout.embedding_weight, layout.head_weight, pp_rank, tuple(layout.stages_of_rank(pp_rank)))


@functools.lru_cache(maxsize=65536)
def _rank_part(n_layers: int, pp: int, virtual: int, per_stage: tuple[int, ...] | None, embedding_weight: float,
               head_weight: float, pp_rank: int, stages: tuple[int, ...]) -> RankPart:
    counts = _stage_layers(n_layers, pp * virtual, per_stage, embedding_weight, head_weight)
    held = tuple(counts[s] for s in stages)
    return RankPart(layers=sum(held), first=0 in stages, last=(len(counts) - 1) in stages, stage_layers=held)


def block_param_specs(inv: ModelInventory, layout: Layout, pp_rank: int) -> list[tuple[ParamSpec, int]]:
    """(parameter, copies) of the transformer blocks a pipeline rank holds: with blocks of several kinds
    (`layer_groups`), as many of each as its stages' layer ranges contain."""
    part = rank_part(inv, layout, pp_rank)
    if not inv.layer_groups:
        return [(p, part.layers) for p in inv.layer]
    counts = stage_layers(inv, layout)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = layout.stages_of_rank(pp_rank)
    specs: list[tuple[ParamSpec, int]] = []
    first = 0
    for count, group in inv.layer_groups:
        held = sum(max(0, min(first + count, starts[s] + counts[s]) - max(first, starts[s])) for s in stages)
        specs += [(p, held) for p in group if held]
        first += count
    return specs


def rank_param_specs(inv: ModelInventory, layout: Layout, pp_rank: int) -> list[tuple[ParamSpec, int]]:
    """(parameter, copies) held by a pipeline rank: its blocks' parameters and the first/last-stage ones.

    A tied output head on a different stage than the embedding is a separate copy there, and so is the
    embedding the multi-token-prediction modules read on the last stage (the pipeline strategy keeps the
    copies in sync).
    """
    part = rank_part(inv, layout, pp_rank)
    specs = block_param_specs(inv, layout, pp_rank)
    if part.first:
        specs += [(p, 1) for p in inv.embedding]
    if part.last:
        specs += [(p, 1) for p in (*inv.head, *inv.mtp)]
        if inv.tied_head is not None and not part.first:
            specs.append((inv.tied_head, 1))
        if inv.mtp_blocks and not part.first:
            specs += [(p, 1) for p in inv.embedding]
    return specs


def rank_numel(inv: ModelInventory, layout: Layout, coords: RankCoords) -> tuple[int, int]:
    """(model-parallel local elements, of which this rank's data-parallel shard) for one rank."""
    return _rank_numel(inv, _numel_key(layout), coords, False)


def rank_hidden_numel(inv: ModelInventory, layout: Layout, coords: RankCoords) -> tuple[int, int]:
    """`rank_numel` of the hidden matrices only (`is_hidden_matrix`): what Muon steps with one state."""
    return _rank_numel(inv, _numel_key(layout), coords, True)


def is_hidden_matrix(inv: ModelInventory, spec: ParamSpec) -> bool:
    """Whether the planner counts `spec` as a hidden matrix (the planner's mirror of
    `trainer.optim.hidden_matrices`): a block's parameter of two or more dimensions (not the embedding,
    the final norm or the output head)."""
    return len(spec.shape) >= 2 and spec not in inv.embedding and spec not in inv.head and spec != inv.tied_head


def _numel_key(layout: Layout) -> tuple:
    # cached on what decides it, so the search's policy and micro-batch variants share the result
    return (layout.tp, layout.pp, layout.virtual_stages, layout.layers_per_stage, layout.embedding_weight,
            layout.head_weight, layout.dp_flavour, layout.dp_replicate, layout.dp_shard, layout.cp, layout.ep)


@functools.lru_cache(maxsize=65536)
def _rank_numel(inv: ModelInventory, key: tuple, coords: RankCoords, hidden_only: bool) -> tuple[int, int]:
    tp, pp, virtual, per_stage, embedding_weight, head_weight, flavour, replicate, shards, cp, ep = key
    layout = Layout(world_size=tp * pp * replicate * shards * cp, dp_replicate=replicate, dp_shard=shards, tp=tp,
                    pp=pp, cp=cp, strategy="", dp_flavour=flavour, virtual_stages=virtual, layers_per_stage=per_stage,
                    embedding_weight=embedding_weight, head_weight=head_weight, ep=ep)
    # expert parallelism: rank i of dp x cp holds expert block i % ep, sharded (FSDP) over the i // ep axis
    dp_cp_index = (coords.dp_replicate * shards + coords.dp_shard) * cp + coords.cp
    # the cp ranks join the partition (mesh order: the cp coordinate is the inner one of each group)
    replica_index = coords.dp_replicate * cp + coords.cp
    shard_index = coords.dp_shard * cp + coords.cp
    full = shard = 0
    flavour = layout.dp_flavour
    for spec, copies in rank_param_specs(inv, layout, coords.pp):
        if hidden_only and not is_hidden_matrix(inv, spec):
            continue
        shape = spec.local_shape(layout.tp)
        if spec.expert and ep > 1:
            shape = (shape[0] // ep, *shape[1:])
        numel = 1
        for size in shape:
            numel *= size
        rows = shape[0]
        row_numel = numel // rows if rows else 0
        if spec.expert and ep > 1:
            # zero3/fsdp: sharded over edp on dim 1 (fsdp.py); zero1/zero2: their states' rows partitioned over
            # edp (ddp.py's ShardedOptimizerStates); ddp: replicated over edp
            if flavour in ("shard_grad_op", "zero3", "hybrid_shard"):
                part = rows * chunk_rows(shape[1], dp_cp_index // ep, layout.edp) * (numel // (rows * shape[1]))
            elif flavour in ("zero1", "zero2"):
                part = chunk_rows(rows, dp_cp_index // ep, layout.edp) * row_numel
            else:
                part = numel
        elif flavour in ("zero1", "zero2"):
            part = chunk_rows(rows, replica_index, layout.replica_group) * row_numel
        elif flavour in ("shard_grad_op", "zero3", "hybrid_shard"):
            part = chunk_rows(rows, shard_index, layout.shard_group) * row_numel
        else:
            part = numel
        full += copies * numel
        shard += copies * part
    return full, shard


def rank_state_bytes(inv: ModelInventory, layout: Layout, coords: RankCoords) -> dict[str, float]:
    """{params, grads, optimizer} bytes one rank holds after a step (what `summary.json` reports)."""
    full, shard = rank_numel(inv, layout, coords)
    sharding = flavour_sharding(layout.dp_flavour)
    held = model_state_bytes(full, shard, sharding, bytes_per_param(layout))
    if layout.hidden_matrix_states is not None and layout.hidden_matrix_states != layout.optimizer_states:
        # Muon: its hidden matrices keep one momentum buffer, not AdamW's two moments
        hidden_full, hidden_shard = rank_hidden_numel(inv, layout, coords)
        fewer = (layout.optimizer_states - layout.hidden_matrix_states) * layout.optimizer_state_bytes
        held["optimizer"] -= fewer * (hidden_shard if sharding.optimizer else hidden_full)
    return held
