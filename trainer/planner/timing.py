"""Model FLOPs, pipeline bubble, step time, throughput and MFU.

Model FLOPs per token (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 5.1, and `CausalLM.flops_per_token`):

    6 x (matmul weights, output head included) + 12 x layers x seq_len x attention width

which for a GPT-3-style model is the paper's 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) per step of B
sequences. MFU counts these model FLOPs only; recomputation is extra hardware work in the step time
(full: one more forward of the checkpointed blocks, Narayanan's 96 instead of 72; attention: the attention
core's forward again).

Step time = per-rank compute / (peak x `plan.matmul_efficiency`) (under a pipeline each stage's share of the
FLOPs, the head on the last one: `stage_compute_shares`), stretched by the pipeline bubble and the
pipeline runtime's per-action overhead, plus the communication that cannot hide behind compute, plus the
optimizer step (memory-bound) and offload traffic. Compute counts hardware FLOPs: the weights' matmuls (model FLOPs plus recomputation) at
`plan.matmul_efficiency`, and the attention core apart, at `plan.attention_efficiency`, less the half of
it a causal fused kernel skips (`causal_block_skipping`). `mode=plan plan.calibrate=true` measures both
efficiencies at the configuration's own sizes (`matmul_shapes`, `attention_shape`) instead of assuming them:
- bubble: (P - 1) / (M + P - 1) for gpipe and 1F1B, (P - 1) / (v M + P - 1) for interleaved 1F1B; the
  zero-bubble schedule is counted at a third of interleaved 1F1B's bubble (Qi et al. 2024's ZB-H1 figure;
  an estimate: its real bubble depends on the backward split); zbv and dualpipev (two stages per rank in a
  V) by playing torch's own order of operations out at equal forward, input- and weight-gradient times
  (trainer/planner/pipeline_sim.py; the steady-state closed forms it reproduces at large M are Qi et al.
  2024 section 6 for ZB-V and the DeepSeek-V3 report's table 2 for DualPipe(V));
- the pipeline runtime's own work per compute action (a chunk's forward, backward, input- or
  weight-gradient pass: schedule bookkeeping, issuing and waiting on its sends and receives), measured per
  machine (`HardwareConfig.pipeline_action_overhead_us`), on the critical path: the V schedules play it out
  with each operation's cost, the closed forms lengthen every slot of the critical path by it
  (`pipeline_time`); the pure bubble stays its own figure (`bubble_s`, `bubble_fraction`);
- tensor-parallel, pipeline and context-parallel traffic is on the critical path (counted in full: an
  upper bound for the ring, which sends the next K/V block while it computes on the current one); DDP's all-reduce hides
  behind the last micro-batch's backward, FSDP's per micro-batch traffic behind that micro-batch's
  compute, whatever exceeds it is exposed; ZeRO-1's parameter all-gather follows the step (exposed). On a
  CPU nothing hides (`overlaps_compute`): gloo's collectives use the cores the compute uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from trainer.planner.communication import Collective
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import V_SCHEDULES, Layout
from trainer.planner.memory import RankCoords, rank_numel
from trainer.planner.params import ModelInventory
from trainer.planner.pipeline_sim import play_v_schedule, v_schedule_bubble, v_stage_rank


def causal_block_skipping(inv: ModelInventory, layout: Layout, device_type: str) -> bool:
    """Whether attention runs in a fused causal kernel that skips the key blocks above the diagonal
    (FlashAttention on a GPU, torch's flash kernel on a CPU, SDPA with is_causal): then it does about half
    the attention-core FLOPs the model-FLOPs convention counts. Not with materialized scores, an explicit
    per-document mask, or (CPU) dropout, which takes SDPA's math path."""
    if inv.attn_impl == "materialized" or layout.document_masking:
        return False
    return not (inv.dropout > 0 and device_type == "cpu")


def matmul_shapes(inv: ModelInventory, layout: Layout, coords: RankCoords) -> list[tuple[int, int, int, int]]:
    """The forward matmuls of one micro-batch on one rank, as (m, k, n, count): tokens x input width x output
    width, after the tensor-parallel split (what `mode=plan plan.calibrate=true` times, with their two
    backward products, to measure `plan.matmul_efficiency` at the configuration's own sizes). A routed
    expert sees top_k / n_experts of the tokens (uniform routing)."""
    from trainer.planner.memory import block_param_specs, rank_part

    tokens = layout.micro_batch_size * layout.local_seq_len
    part = rank_part(inv, layout, coords.pp)
    shapes: dict[tuple[int, int, int], int] = {}

    def add(shape: tuple[int, ...], expert: bool, copies: int) -> None:
        if expert:  # [experts, out, in]: this rank's experts, each on its share of the tokens
            experts, out, width = shape[0] // layout.ep, shape[-2], shape[-1]
            key = (max(1, round(tokens * inv.top_k / max(inv.n_experts, 1))), width, out)
            shapes[key] = shapes.get(key, 0) + copies * experts
        else:
            key = (tokens, shape[-1], shape[0])
            shapes[key] = shapes.get(key, 0) + copies

    for spec, copies in block_param_specs(inv, layout, coords.pp):
        if spec.matmul:
            add(spec.local_shape(layout.tp), spec.expert, copies)
    if part.last:
        for spec in (*inv.head, *inv.mtp):
            if spec.matmul:
                add(spec.local_shape(layout.tp), spec.expert, 1)
        for _ in range(inv.mtp_blocks):  # each MTP depth runs the shared output head once more
            add((inv.vocab_size // layout.tp, inv.dim), False, 1)
        if inv.tied:  # the head multiplies with the embedding's weight (vocab rows split under tp)
            add((inv.vocab_size // layout.tp, inv.dim), False, 1)
    return [(m, k, n, count) for (m, k, n), count in shapes.items()]


def attention_shape(inv: ModelInventory, layout: Layout) -> tuple[int, int, int, int, int]:
    """One rank's attention core per micro-batch and layer as (batch, query heads, kv heads, tokens, head
    dim): the heads split over tp (and over cp under all_to_all, which attends over the whole sequence),
    the tokens over cp under the ring (`mode=plan plan.calibrate=true` times SDPA at this shape)."""
    heads, kv_heads = inv.n_heads // layout.tp, max(1, inv.n_kv_heads // layout.tp)
    if layout.cp > 1 and layout.cp_method == "all_to_all":
        return (layout.micro_batch_size, max(1, heads // layout.cp), max(1, kv_heads // layout.cp),
                layout.seq_len, inv.head_dim)
    return layout.micro_batch_size, heads, kv_heads, layout.local_seq_len, inv.head_dim


def recomputed_layers(inv: ModelInventory, layout: Layout) -> int:
    """Blocks of the model whose whole forward runs again in the backward (full: all; every_n: layers
    n-1, 2n-1, ...)."""
    if layout.checkpointing == "full":
        return inv.n_layers
    if layout.checkpointing == "every_n":
        return inv.n_layers // max(1, layout.checkpoint_every_n)
    return 0


def schedule_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Fraction of a step the pipeline's ranks idle at free communication and bookkeeping (0 without
    pipelining): the bubble alone."""
    p, m, v = pp, microbatches, virtual_stages
    if p == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in V_SCHEDULES:
        # ZB-V (Qi et al. 2024, section 6) and DualPipeV (DeepSeek-V3 report, table 2): their steady-state
        # closed forms vanish at equal forward/input/weight times; the warm-up and cool-down at a few
        # micro-batches do not, so the planner plays torch's order of operations out (pipeline_sim.py)
        return v_schedule_bubble(schedule, p, m)
    bubble = (p - 1) / v
    if schedule == "zero_bubble":
        bubble /= 3
    return bubble / (m + bubble)


def bubble_fraction(layout: Layout) -> float:
    """Fraction of a step the pipeline's ranks idle at free communication and bookkeeping (0 without
    pipelining)."""
    return schedule_bubble(layout.schedule, layout.pp, layout.num_microbatches, layout.virtual_stages)


def pipeline_actions(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Compute actions the busiest rank runs per step (each pays the runtime's per-action overhead): a
    forward and a full backward per micro-batch and stage (gpipe, 1f1b, interleaved_1f1b), a forward, an
    input- and a weight-gradient pass (zero_bubble), torch's own list for zbv and dualpipev (whose
    overlapped F + B pairs run as two actions). 0 without pipelining."""
    if pp == 1:
        return 0
    if schedule in V_SCHEDULES:
        return max(play_v_schedule(schedule, pp, microbatches).actions)
    return (3 if schedule == "zero_bubble" else 2) * virtual_stages * microbatches


def stage_compute_shares(inv: ModelInventory, layout: Layout) -> tuple[float, ...]:
    """Each pipeline stage's share of the model FLOPs, stages in order (pp x virtual_stages of them, as the
    pipeline strategy's balancing places the layers, `stage_layers`): its blocks' matmuls and attention cores
    (each block of a `layer_groups` model at its own width), and on the last stage the output head and
    DeepSeek-V3's MTP modules; the embedding is a lookup. A step's recomputation (blocks only) is not in the
    shares. `(1.0,)` without pipelining."""
    from trainer.planner.memory import stage_layers

    return _stage_shares(inv, layout.seq_len, stage_layers(inv, layout))


@functools.lru_cache(maxsize=4096)
def _stage_shares(inv: ModelInventory, seq_len: int, counts: tuple[int, ...]) -> tuple[float, ...]:
    # cached: the search asks for the same few splits thousands of times
    if len(counts) == 1:
        return (1.0,)
    per_layer = inv.layer_flops_per_token(seq_len)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    flops = [float(sum(per_layer[start:start + count])) for start, count in zip(starts, counts, strict=True)]
    flops[-1] += inv.flops_per_token(seq_len) - sum(per_layer)  # the head (and MTP) on the last stage
    total = sum(flops)
    return tuple(f / total for f in flops)


def stage_pass_fractions(inv: ModelInventory, layout: Layout) -> tuple[tuple[float, float, float], ...]:
    """Per pipeline stage, the fractions of its compute in the forward, the input-gradient and the
    weight-gradient pass (what zbv and dualpipev schedule apart), by FLOPs: a matmul costs the same in each
    (its forward, its input's gradient, its weight's gradient), the attention core has no weights, so its
    backward (twice its forward) is all in the input-gradient pass. The output head is matmuls only."""
    from trainer.planner.memory import stage_layers

    counts = stage_layers(inv, layout)
    shares = stage_compute_shares(inv, layout)
    total = inv.flops_per_token(layout.seq_len)
    core = 3 * inv.attention_core_forward_flops_per_token(layout.seq_len)  # forward and backward, per block
    fractions = []
    for share, count in zip(shares, counts, strict=True):
        flops = share * total
        attention = count * core
        matmul = flops - attention
        fractions.append(((matmul + attention) / 3 / flops, (matmul + 2 * attention) / 3 / flops,
                          matmul / 3 / flops))
    return tuple(fractions)


@dataclass(frozen=True)
class PipelineTime:
    """The pipeline's part of one rank's step: its compute, the bubble, and the runtime's per-action overhead
    on the critical path, in seconds (their sum is the step before communication and the optimizer, the same
    for every rank of the pipeline; the compute, and so the idle time, is the rank's own)."""

    compute_s: float
    bubble_s: float  # the rest of the step at free communication and bookkeeping
    overhead_s: float  # what the per-action overhead adds: its own time and the bubble slots it lengthens
    actions: int  # compute actions of the busiest rank per step

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.overhead_s

    @property
    def idle_fraction(self) -> float:
        """1 - compute / step: what a rank measures as idle (bubble and overhead)."""
        return 1 - self.compute_s / self.step_s if self.step_s > 0 else 0.0


def pipeline_time(schedule: str, pp: int, microbatches: int, virtual_stages: int, compute_s: float,
                  action_overhead_s: float, stage_shares: tuple[float, ...] | None = None,
                  pp_rank: int = 0,
                  pass_fractions: tuple[tuple[float, float, float], ...] | None = None) -> PipelineTime:
    """Bubble and per-action overhead of a pipeline step whose ranks compute `compute_s` each when the work
    is spread evenly, every compute action costing `action_overhead_s` more
    (`HardwareConfig.pipeline_action_overhead_us`), for rank `pp_rank`. `stage_shares` (each stage's share
    of the compute, `stage_compute_shares`; even without) sets each stage's compute: stage s computes
    `compute_s` x pp x its share, a rank the sum over its stages.

    zbv and dualpipev: torch's order of operations played out with each stage's forward, input- and
    weight-gradient passes at their `pass_fractions` of its compute per micro-batch (`stage_pass_fractions`;
    a third each without), with and without the overhead (pipeline_sim.py). gpipe and 1F1B (Narayanan et
    al. 2021): the critical path runs every stage once and the slowest one M - 1 times more, t_1 + ... + t_P
    + (M - 1) max t (M + P - 1 slots of t at even stages), each stage's time per micro-batch t holding a
    forward and a backward action, so 2 x overhead more. Interleaved 1F1B and zero_bubble: the closed-form
    bubble at the busiest rank's compute, every action lengthening its slot: step = (busiest compute +
    actions x overhead) / (1 - bubble) (zero_bubble three actions a slot, an estimate, as its bubble is)."""
    if pp == 1:
        return PipelineTime(compute_s, 0.0, 0.0, 0)
    bubble = schedule_bubble(schedule, pp, microbatches, virtual_stages)
    actions = pipeline_actions(schedule, pp, microbatches, virtual_stages)
    stages = pp * (2 if schedule in V_SCHEDULES else virtual_stages)
    shares = stage_shares or (1.0 / stages,) * stages
    if len(shares) != stages:
        raise ValueError(f"{len(shares)} stage shares for {stages} stages of {schedule} over pp={pp}")
    per_stage = [compute_s * pp * share for share in shares]
    overhead = max(0.0, action_overhead_s)
    if schedule in V_SCHEDULES:
        owner = [v_stage_rank(stage, pp) for stage in range(stages)]
        thirds = pass_fractions or ((1 / 3, 1 / 3, 1 / 3),) * stages
        costs = tuple((c * f / microbatches, c * i / microbatches, c * w / microbatches, c * (i + w) / microbatches)
                      for c, (f, i, w) in zip(per_stage, thirds, strict=True))
        pure = play_v_schedule(schedule, pp, microbatches, stage_costs=costs).makespan
        loaded = play_v_schedule(schedule, pp, microbatches, overhead=overhead, stage_costs=costs).makespan
    else:
        owner = [stage % pp for stage in range(stages)]
        ranks = [sum(c for c, r in zip(per_stage, owner, strict=True) if r == rank) for rank in range(pp)]
        if schedule in ("gpipe", "1f1b"):
            slot = [c / microbatches for c in per_stage]
            pure = sum(slot) + (microbatches - 1) * max(slot)
            loaded = pure + 2 * overhead * (microbatches + pp - 1)
        else:
            pure = max(ranks) / (1 - bubble)
            loaded = (max(ranks) + actions * overhead) / (1 - bubble)
    mine = sum(c for c, r in zip(per_stage, owner, strict=True) if r == pp_rank)
    return PipelineTime(mine, max(0.0, pure - mine), loaded - pure, actions)


@dataclass
class Timing:
    """Per-step time of one rank and the throughput it implies."""

    flops_per_token: float  # model FLOPs (Narayanan), no recomputation
    flops_per_step: float  # model FLOPs of one optimizer step, all ranks
    recompute_flops_per_step: float  # extra hardware FLOPs of recomputation, all ranks
    compute_s: float  # this rank's matmuls, without bubble
    bubble_s: float  # the bubble alone (communication and bookkeeping free)
    pipeline_overhead_s: float  # the pipeline runtime's per-action overhead on the critical path
    exposed_comm_s: float
    optimizer_s: float
    offload_s: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float


def overlaps_compute(hardware: HardwareConfig) -> bool:
    """Whether collectives can run beside compute. Not on a CPU: gloo reduces, copies and moves the bytes on
    the cores the forward and backward use (a GPU leaves that to its copy engines and links), so no
    collective hides there. Measured (benchmarks/strategy_auto.py, tiny model on 4 gloo processes on 2 cores):
    zero3, whose per-block gathers the overlap rule counted as hidden (134 ms of traffic, 0 exposed), ran 1.2x
    ddp's step, and ep=4, whose all-to-alls it hid too (189-311 ms), 1.4-2.4x the layout without ep."""
    return hardware.device_type != "cpu"


def estimate_time(inv: ModelInventory, layout: Layout, coords: RankCoords, hardware: HardwareConfig,
                  collectives: list[Collective], matmul_efficiency: float,
                  attention_efficiency: float | None = None) -> Timing:
    """One rank's step time on `hardware` and what it implies (see the module docstring for the terms)."""
    tokens = layout.global_batch_size * layout.seq_len
    per_token = inv.flops_per_token(layout.seq_len)
    model_flops = per_token * tokens
    extra_per_token = recomputed_layers(inv, layout) * inv.block_forward_flops_per_token(layout.seq_len)
    if layout.checkpointing == "attention":
        extra_per_token = inv.n_layers * inv.attention_core_forward_flops_per_token(layout.seq_len)
    recompute_flops = extra_per_token * tokens
    # The attention core runs in its own kernel, at its own efficiency, on hardware FLOPs: the model FLOPs
    # count it unmasked (Narayanan's convention, kept for MFU), a causal kernel skips about half of it
    # (forward, backward and a recomputed forward alike).
    core_forward = inv.attention_core_forward_flops_per_token(layout.seq_len)
    recomputed_cores = inv.n_layers if layout.checkpointing == "attention" else recomputed_layers(inv, layout)
    attention_flops = (3 * (inv.n_layers + inv.mtp_blocks) + recomputed_cores) * core_forward * tokens
    attention_hw = attention_flops * (0.5 if causal_block_skipping(inv, layout, hardware.device_type) else 1.0)
    peak = hardware.peak_flops(layout.compute_dtype)
    even = ((model_flops + recompute_flops - attention_flops) / (peak * matmul_efficiency)
            + attention_hw / (peak * (attention_efficiency or matmul_efficiency))) / layout.world_size
    bubble = bubble_fraction(layout)
    m = layout.num_microbatches
    # a pipeline's stages compute unequal shares (the head on the last one); the step waits for the slowest
    shares = stage_compute_shares(inv, layout) if layout.pp > 1 else None
    passes = stage_pass_fractions(inv, layout) if layout.pp > 1 and layout.schedule in V_SCHEDULES else None
    pipe = pipeline_time(layout.schedule, layout.pp, m, layout.virtual_stages, even,
                         hardware.pipeline_action_overhead_us * 1e-6, shares, coords.pp, passes)
    compute = pipe.compute_s  # this rank's
    per_microbatch = compute / m
    # on the critical path: tensor- and pipeline-parallel traffic, ZeRO-1's gather after the step
    zero1_gather = [c for c in collectives if c.op == "all-gather" and layout.dp_flavour in ("zero1", "zero2")]
    exposed = sum(c.time_s for c in collectives if c.dimension in ("tp", "pp", "cp")) + sum(
        c.time_s for c in zero1_gather)
    dp_time = sum(c.time_s for c in collectives if c.dimension == "dp" and c not in zero1_gather)
    if not overlaps_compute(hardware):
        exposed = sum(c.time_s for c in collectives)
    elif layout.fsdp:
        exposed += max(0.0, dp_time - compute) if m == 1 else m * max(0.0, dp_time / m - per_microbatch)
    else:
        exposed += max(0.0, dp_time - per_microbatch * 2 / 3)  # behind the last backward (2/3 of its compute)
    full, shard = rank_numel(inv, layout, coords)
    optimizer_numel = shard if layout.dp_flavour != "ddp" and layout.dp_flavour != "none" else full
    # AdamW reads params, grads and both moments and writes params and moments (7 tensors of the step's
    # numel), in the parameters' dtype
    touched = optimizer_numel * (3 + 2 * layout.optimizer_states) * layout.param_bytes
    offload = 0.0
    if layout.offload and hardware.device_type != "cpu":
        host_bw = hardware.host_memory_bandwidth_gbps * 1e9 / hardware.devices_per_node
        optimizer = touched / host_bw
        # every gather copies the shards to the device, every reduce-scatter copies gradient shards back
        gathers = 2 if layout.reshard_after_forward else 1
        link = hardware.host_to_device_bandwidth_gbps * 1e9
        offload = m * shard * (gathers * layout.param_bytes + layout.reduce_bytes) / link
    elif layout.offload_optimizer and hardware.device_type != "cpu":
        # ZeRO-Offload: the step on the host over this rank's partition; its gradients go down and the
        # updated parameters come back once per step
        optimizer = touched / (hardware.host_memory_bandwidth_gbps * 1e9 / hardware.devices_per_node)
        offload = optimizer_numel * (layout.param_bytes + layout.reduce_bytes) / (
            hardware.host_to_device_bandwidth_gbps * 1e9)
    else:
        optimizer = touched / (hardware.memory_bandwidth_gbps * 1e9)
    step = pipe.step_s + exposed + optimizer + offload
    tokens_per_s = tokens / step
    return Timing(
        flops_per_token=per_token, flops_per_step=model_flops, recompute_flops_per_step=recompute_flops,
        compute_s=compute, bubble_s=pipe.bubble_s, pipeline_overhead_s=pipe.overhead_s, exposed_comm_s=exposed, optimizer_s=optimizer, offload_s=offload,
        step_time_s=step, tokens_per_s=tokens_per_s,
        mfu=per_token * tokens_per_s / (layout.world_size * peak), bubble_fraction=bubble,
    )

