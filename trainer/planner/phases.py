"""The device-memory peak of one rank: the largest of the phases of a training step, not a sum of terms.

A step's memory rises and falls, and its parts do not all exist at once. Between steps a rank holds its
parameters and optimizer states (the gradients are None: `zero_grad(set_to_none=True)`); the forward adds
the saved activations (trainer/planner/activations.py, Korthikanti et al. 2022's accounting with this
code base's number formats); the backward frees them block by block as the gradients appear; the
optimizer step reads the gradients. So the peak is the maximum over these phases (per rank, the same
logic under data, tensor, pipeline and context parallelism, each term being that rank's share):

  forward               end of a micro-batch's forward, before its loss: the saved activations (without
                        this micro-batch's log-probabilities) + the logits + autocast's cache of weight
                        casts that nothing saves (checkpointed blocks hold theirs until the forward's
                        autocast region ends) + gathered parameters (FSDP, 3d's replicate)
  loss_backward         the start of the backward: every saved activation and the logits, plus the
                        loss's two fp32 gradients, w.r.t. the log-probabilities and w.r.t. the fp32
                        logits (2 x 4 bytes x tokens x vocabulary: the log-softmax's backward reads the
                        first, writes the second, while its saved output still exists). The loss's own
                        forward (an fp32 copy of the logits beside its log-softmax) stays below this.
                        Compiled (`trainer.compile`), the loss's backward writes one gradient of the
                        logits' size in their dtype.
  last_block_backward   the backward of the last block: the head's activations freed, its gradients
                        made, one block's backward transient (`block backward`)
  first_block_backward  the backward of the first block: one block of this micro-batch's activations
                        left, nearly every gradient made
  backward_end          every gradient of the step (zero2's whole local gradient and its reduce-scatter
                        buckets, FSDP's unsharded accumulators)
  optimizer_step        parameters + optimizer states + gradients + the step's intermediates
  bucket_rebuild        DDP (ddp, zero1) rebuilds its gradient buckets in the order the first backward
                        produced the gradients, at the start of the second forward: the new buckets are
                        made before the old ones go, two sets of gradients' memory for a moment

Each phase is params + optimizer + the gradients present + the activations present + its temporaries.
Gradients present: none at the first micro-batch's forward and the backward's start (they exist only
once a backward made them), except DDP's buckets (`gradient_as_bucket_view`: allocated with the
wrapper, never freed, the gradients are views of them); from the second micro-batch of an accumulating
step on, the gradients held between micro-batches (the whole gradients; zero2's whole local gradient
before its reduce-scatter; FSDP's sharded gradients when it reduces every micro-batch, its unsharded
accumulators when it reduces once per step); for a pipeline rank, when some micro-batch's backward ran
before its in-flight peak (1F1B with more micro-batches than in flight; never under gpipe). Within the
backward the gradients of the first micro-batch grow from none to all: the blocks' phases count those of
the parameters whose backward has run (the head's and one block's at the last block; all but the
embedding's at the first).

Measured on an NVIDIA H200 (benchmarks/gpu_memory.py, Llama 3 8B width, seq 8192, bf16 autocast, one
micro-batch): the allocator's peak is the backward's start, `loss_backward`, under every checkpointing
policy; the sum of all terms (the planner's former total) overestimated it by 6-19%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainer.planner.activations import ActivationEstimate
from trainer.planner.layout import Layout
from trainer.planner.memory import RankCoords, rank_numel, rank_param_specs, rank_part
from trainer.planner.params import ModelInventory

PHASES = ("forward", "loss_backward", "last_block_backward", "first_block_backward", "backward_end",
          "optimizer_step", "bucket_rebuild")
PHASE_DESCRIPTIONS = {
    "forward": "end of the forward (before the loss)",
    "loss_backward": "start of the backward (the loss's fp32 gradients)",
    "last_block_backward": "backward of the last block",
    "first_block_backward": "backward of the first block",
    "backward_end": "end of the backward (every gradient)",
    "optimizer_step": "optimizer step",
    "bucket_rebuild": "DDP's buckets rebuilt before the second step",
}


@dataclass
class Transients:
    """Named buffers besides parameters, gradients, optimizer states and saved activations (bytes)."""

    # Through every micro-batch's forward and backward (gathered parameters).
    gathered: dict[str, float] = field(default_factory=dict)
    # During one block's backward (beyond the activation model's working set and recompute).
    block_backward: dict[str, float] = field(default_factory=dict)
    # At the end of the backward, while the gradients are reduced (zero2's reduce-scatter buckets).
    reduction: dict[str, float] = field(default_factory=dict)
    # During the optimizer step.
    step: dict[str, float] = field(default_factory=dict)


@dataclass
class GradientPresence:
    """Gradient bytes present on the device at the points of a step that decide the phases."""

    first_start: float  # the first micro-batch's forward and the start of its backward
    later_start: float  # a later micro-batch's (gradient accumulation; a pipeline's steady state)
    end: float  # the end of the backward: every gradient of the step, unreduced buffers included
    step: float  # the optimizer step: the gradients as the rank holds them after the reduction


def gradient_presence(inv: ModelInventory, layout: Layout, coords: RankCoords, held: float) -> GradientPresence:
    """What of the gradients exists when (see the module docstring); `held` = the device bytes of the
    gradients the rank holds at the optimizer step (`rank_state_bytes`, zero on the device if offloaded)."""
    full, _ = rank_numel(inv, layout, coords)
    accumulating = layout.num_microbatches > 1
    if layout.dp_flavour in ("ddp", "zero1") and layout.strategy != "3d":
        # DistributedDataParallel's buckets (gradient_as_bucket_view): the gradients' memory, for good
        return GradientPresence(held, held, held, held)
    if layout.dp_flavour == "zero2" and layout.replica_group > 1:
        # the backward accumulates whole local gradients; the step's reduce-scatter leaves this rank's rows
        local = full * layout.param_bytes if held else 0.0
        return GradientPresence(0.0, local, local, held)
    if layout.fsdp and accumulating and (layout.grad_sync == "step" or layout.pp > 1):
        # the reduction waits for the last micro-batch: every unit's gradient accumulates unsharded; the last
        # backward reduce-scatters them unit by unit, each unsharded gradient freed as its shard appears
        unsharded = full * layout.reduce_bytes
        return GradientPresence(0.0, unsharded, unsharded, held)
    return GradientPresence(0.0, held, held, held)


def _fractions(inv: ModelInventory, layout: Layout, coords: RankCoords) -> tuple[float, float]:
    """(the head's and one block's, the embedding's) share of the elements this rank's gradients cover."""
    part = rank_part(inv, layout, coords.pp)
    first = last = blocks = 0.0
    embedding = {id(p) for p in inv.embedding}
    head = {id(p) for p in (*inv.head, *inv.mtp, inv.tied_head) if p is not None}  # a tied head's copy too
    for spec, copies in rank_param_specs(inv, layout, coords.pp):
        numel = copies * math.prod(spec.local_shape(layout.tp))
        if id(spec) in embedding:
            first += numel
        elif id(spec) in head:
            last += numel
        else:
            blocks += numel
    total = first + last + blocks
    if not total:
        return 1.0, 0.0
    one_block = blocks / part.layers if part.layers else 0.0
    return (last + one_block) / total, first / total


def step_phases(inv: ModelInventory, layout: Layout, coords: RankCoords, acts: ActivationEstimate,
                device_state: dict[str, float], transients: Transients
                ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """({phase: {params, grads, optimizer, activations, temporaries, total}}, {phase: its temporaries by
    name}) of one rank, in device bytes (see the module docstring)."""
    grads = gradient_presence(inv, layout, coords, device_state["grads"])
    accumulating = layout.num_microbatches > 1
    # the forward and the backward's start of the micro-batch with the most gradients present
    later_at_peak = layout.num_microbatches > acts.in_flight if layout.pp > 1 else accumulating
    start = grads.later_start if later_at_peak else grads.first_start
    in_backward = grads.later_start if accumulating else grads.first_start
    head_and_block, embedding = _fractions(inv, layout, coords)
    in_flight = max(acts.in_flight, 1.0)
    # one micro-batch's saved block activations on the device, and those of its blocks other than the one
    # whose backward runs (activation offload: in host memory, but for the block in flight)
    if acts.host:
        one_blocks, other_blocks = acts.per_layer_none, 0.0
    else:
        one_blocks = acts.blocks / in_flight
        other_blocks = one_blocks * (acts.layers - 1) / acts.layers if acts.layers else 0.0
    one_first = acts.first_stage / in_flight
    one_head = acts.last_stage / acts.head_in_flight if acts.head_in_flight else 0.0
    saved = acts.device
    gathered = dict(transients.gathered)
    held = {"logits held by the training step": acts.held_logits} if acts.held_logits else {}
    block = {}
    if acts.recompute_transient:
        block["recomputed block"] = acts.recompute_transient
    if acts.gradient_working_set and acts.layers:
        block["a block's backward (its input gradients)"] = acts.gradient_working_set
    block.update(transients.block_backward)
    phases: dict[str, tuple[float, float, dict[str, float]]] = {
        "forward": (start, saved - acts.log_probs,
                    {**gathered, **held, "autocast's cache of weight casts": acts.cast_cache}),
        "loss_backward": (start, saved, {**gathered, **held,
                                         "the loss's gradients": acts.loss_backward}),
        "last_block_backward": (in_backward + (grads.end - in_backward) * head_and_block, saved - one_head,
                                {**gathered, **held, **block}),
        "first_block_backward": (in_backward + (grads.end - in_backward) * (1 - embedding),
                                 saved - one_head - other_blocks, {**gathered, **held, **block}),
        "backward_end": (grads.end, saved - one_head - one_blocks - one_first,
                         {**gathered, **held, **transients.reduction}),
        "optimizer_step": (grads.step, 0.0, dict(transients.step)),
    }
    if layout.dp_flavour in ("ddp", "zero1") and layout.strategy != "3d":
        phases["bucket_rebuild"] = (grads.step, 0.0, {"DDP's previous buckets": grads.step})
    if not acts.layers:  # a stage without blocks (a pipeline rank holding only the embedding or head)
        phases.pop("last_block_backward")
        phases.pop("first_block_backward")
    rows: dict[str, dict[str, float]] = {}
    named: dict[str, dict[str, float]] = {}
    for name, (present, activations, temporaries) in phases.items():
        named[name] = {k: v for k, v in temporaries.items() if v}
        row = {"params": device_state["params"], "grads": present, "optimizer": device_state["optimizer"],
               "activations": max(activations, 0.0), "temporaries": sum(named[name].values())}
        row["total"] = sum(row.values())
        rows[name] = row
    return rows, named
