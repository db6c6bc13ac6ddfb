"""`plan(cfg) -> Plan`: memory per rank, communication, step time and fit of a composed config."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from trainer.planner.accumulation import resolve_grad_sync
from trainer.planner.hardware import HardwareConfig
from trainer.planner.layout import Layout, layout_from_config, model_config
from trainer.planner.memory import (
    GB,
    RankCoords,
    bytes_per_param,
    describe_convention,
)
from trainer.planner.params import ModelInventory, inventory
from trainer.planner.estimate import (
    MEMORY_FIELDS,
    PlanOptions,
    RankEstimate,
    Suggestion,
    estimate_rank,
    evaluate,
    fits,
    host_bytes_per_rank,
    usable_bytes,
)

@dataclass
class Plan:
    """The planner's answer for one configuration. `to_json()` documents every field (docs/ARCHITECTURE.md)."""

    model: str
    num_params: int
    hardware: str
    world_size: int
    strategy: str
    dp: int
    tp: int
    pp: int
    cp: int
    context_parallel: str  # which context-parallel method the estimate assumes, in words ("" with cp=1)
    dp_flavour: str
    checkpointing: str
    precision: str
    micro_batch_size: int
    num_microbatches: int
    rank: int  # the rank reported (the one with the highest device memory, or plan.rank)
    # bytes, MEMORY_FIELDS of `rank`: params, grads, optimizer as held, activations as saved by the forward,
    # temporaries and total of the peak phase (`peak_phase`; details["phases"] has every phase's parts)
    memory: dict[str, float]
    state_bytes: dict[str, float]  # params, grads, optimizer this rank holds wherever they live
    host_bytes: float
    capacity_bytes: float  # usable device memory (after reserved memory and headroom)
    host_capacity_bytes: float
    fits: bool
    shortfall: list[str]  # what is short, in words
    bubble_fraction: float
    flops_per_token: float
    flops_per_step: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    convention: str
    activation_formula: str
    per_rank_total: dict[int, float]  # device bytes of each pipeline position's rank
    details: dict[str, Any]  # temporaries, activation terms, step time parts
    communication: list[dict[str, Any]]
    # Parameters a token uses (= num_params for a dense model; top_k of n_experts experts for an MoE).
    num_active_params: int = 0
    ep: int = 1  # expert-parallel size (experts split over ep of the dp x cp ranks)
    exact: Optional[dict[str, int]] = None  # params/grads/optimizer bytes counted on the meta device
    exact_error: Optional[str] = None
    warnings: list[str] = field(default_factory=list)
    suggestions: list[Suggestion] = field(default_factory=list)
    # The phase of a step at which `rank`'s device memory peaks (trainer/planner/phases.py: PHASES).
    peak_phase: str = ""

    def memory_gb(self) -> dict[str, float]:
        return {k: self.memory[k] / GB for k in MEMORY_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """Every figure, with memory in GB (1e9 bytes) under `memory_gb`."""
        data = asdict(self)
        data.pop("memory")
        data["memory_gb"] = {**self.memory_gb(), "host": self.host_bytes / GB,
                             "capacity": self.capacity_bytes / GB}
        data["per_rank_total_gb"] = {str(k): v / GB for k, v in self.per_rank_total.items()}
        data.pop("per_rank_total")
        data["suggestions"] = [asdict(s) | {"command": s.command} for s in self.suggestions]
        return data

    def to_json(self) -> str:
        """One line of JSON (see `to_dict`)."""
        return json.dumps(self.to_dict(), default=str, separators=(",", ":"))


def hardware_from_config(cfg: DictConfig) -> HardwareConfig:
    node = cfg.get("hardware", None)
    if node is None:
        return HardwareConfig()
    values = OmegaConf.to_container(node, resolve=True)
    return HardwareConfig(**{k: v for k, v in values.items() if not k.startswith("_")})  # type: ignore[union-attr]


def runnable_warnings(cfg: DictConfig, layout: Layout) -> list[str]:
    """What would stop `mode=train` on this config that the plan does not depend on."""
    from hydra.utils import instantiate

    warnings = []
    if layout.tp > 1:
        try:
            instantiate(cfg.strategy).check_tensor_parallel(model_config(cfg), layout.tp, layout.seq_len,
                                                            layout.sequence_parallel)
        except ValueError as error:
            warnings.append(f"cannot run as configured: {error}")
    return warnings


def plan(cfg: DictConfig, *, exact: Optional[bool] = None, search: Optional[bool] = None,
         overrides: Optional[list[str]] = None) -> Plan:
    """The plan of a composed, validated config.

    `exact` and `search` left as None follow `plan.exact` and `plan.search` for a `mode=plan` config, and
    are off otherwise: a caller that only asks whether a training config fits (the sweep's
    `sweep.skip_unfit`) gets the analytic answer in milliseconds. With `search` (always, in `mode=plan`,
    when the config does not fit) `suggestions` holds the best configurations that fit the same world
    size and hardware; `overrides` (the command line that composed `cfg`) is what their commands start
    from and what they are validated with (default: Hydra's record of the command line, or the model,
    batch, precision and hardware values of `cfg`).
    """
    options = PlanOptions.of(cfg)
    node = cfg.get("plan", None)
    planning = node is not None and cfg.get("mode", "train") == "plan"
    if exact is None:
        exact = planning and bool(node.exact)
    top = int(node.top) if node is not None else 5
    hardware = hardware_from_config(cfg)
    inv = inventory(model_config(cfg))
    # grad_sync=auto: what a run on this hardware would choose (trainer/planner/accumulation.py)
    layout, _ = resolve_grad_sync(inv, layout_from_config(cfg), hardware, options)
    estimates = evaluate(inv, layout, hardware, options)
    if options.rank is not None:
        coords = RankCoords.of(int(options.rank), layout)
        chosen = estimate_rank(inv, layout, hardware, coords, options)
    else:
        chosen = max(estimates, key=lambda e: e.device["total"])
    ok, short = fits(estimates, hardware, options)
    result = build_plan(cfg, inv, layout, hardware, options, chosen, estimates, ok, short)
    result.warnings += runnable_warnings(cfg, layout)
    if exact:
        from trainer.planner.exact import ExactUnavailable, exact_state_bytes

        try:
            result.exact = exact_state_bytes(cfg, chosen.rank)
        except ExactUnavailable as error:
            result.exact_error = str(error)
    if search is None:
        search = planning and (bool(node.search) or not ok)
    if search:
        from trainer.planner.search import search_configurations

        result.suggestions = search_configurations(cfg, inv, layout, hardware, options, top=top,
                                                   base_overrides=overrides)
    return result


def build_plan(cfg: DictConfig, inv: ModelInventory, layout: Layout, hardware: HardwareConfig, options: PlanOptions,
               chosen: RankEstimate, estimates: list[RankEstimate], ok: bool, short: list[str]) -> Plan:
    t = chosen.timing
    a = chosen.activations
    details = {
        "temporaries": chosen.temporaries,
        "optimizer_step_temporaries": chosen.step_temporaries,
        # what exists at each phase of a step (bytes; the largest is the total) and its temporaries by name
        "phases": chosen.phases,
        "phase_temporaries": chosen.phase_temporaries,
        "activations": {
            "per_layer_none_bytes": a.per_layer_none, "per_layer_kept_bytes": a.per_layer_kept,
            "layers": a.layers, "checkpointed_layers": a.checkpointed, "in_flight_microbatches": a.in_flight,
            "blocks_bytes": a.blocks, "first_stage_bytes": a.first_stage, "last_stage_bytes": a.last_stage,
            "pipeline_boundary_bytes": a.boundaries,
            "notes": a.notes,
        },
        "time": {"compute_s": t.compute_s, "bubble_s": t.bubble_s, "pipeline_overhead_s": t.pipeline_overhead_s,
                 "exposed_communication_s": t.exposed_comm_s,
                 "optimizer_s": t.optimizer_s, "offload_s": t.offload_s,
                 "recompute_flops_per_step": t.recompute_flops_per_step},
        "bytes_per_param": asdict(bytes_per_param(layout)),
        "matmul_efficiency": options.matmul_efficiency,
        "attention_efficiency": options.attention_efficiency or options.matmul_efficiency,
        "headroom": options.headroom,
    }
    return Plan(
        model=str(cfg.model.name), num_params=inv.num_params(), num_active_params=inv.num_active_params(), ep=layout.ep,
        hardware=hardware.name, world_size=layout.world_size,
        strategy=layout.strategy, dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
        context_parallel=context_parallel_statement(layout), dp_flavour=layout.dp_flavour,
        checkpointing=layout.checkpointing, precision=layout.precision, micro_batch_size=layout.micro_batch_size,
        num_microbatches=layout.num_microbatches, rank=chosen.rank,
        memory=dict(chosen.device), state_bytes=dict(chosen.state), host_bytes=chosen.host,
        capacity_bytes=usable_bytes(hardware, options.headroom),
        host_capacity_bytes=host_bytes_per_rank(hardware, options.headroom),
        fits=ok, shortfall=short, bubble_fraction=t.bubble_fraction, flops_per_token=t.flops_per_token,
        flops_per_step=t.flops_per_step, step_time_s=t.step_time_s, tokens_per_s=t.tokens_per_s, mfu=t.mfu,
        convention=describe_convention(layout), activation_formula=activation_formula(inv, layout),
        per_rank_total={e.rank: e.device["total"] for e in estimates}, details=details,
        communication=[{"dimension": c.dimension, "op": c.op, "group_size": c.group_size, "count": c.count,
                        "payload_bytes": c.payload_bytes, "sent_bytes": c.sent_bytes, "time_s": c.time_s,
                        "spans_nodes": c.spans_nodes} for c in chosen.collectives],
        warnings=list(chosen.activations.notes), peak_phase=chosen.peak_phase,
    )


def context_parallel_statement(layout: Layout) -> str:
    """The context-parallel method the estimate assumes, in words (empty without context parallelism)."""
    if layout.cp == 1:
        return ""
    tokens = f"each rank holds {layout.local_seq_len:,} of the {layout.seq_len:,} tokens of a sequence"
    if layout.cp_method == "ring":
        return (f"context parallel cp={layout.cp}, ring attention (cp_method=ring): {tokens} as chunks i and "
                f"2cp-1-i; its K/V block goes round the ring cp-1 times forward and backward, fp32 K/V gradients "
                f"cp hops; activations / cp, no s x s scores kept")
    return (f"context parallel cp={layout.cp}, all-to-all (cp_method=all_to_all, DeepSpeed-Ulysses): {tokens}; "
            f"q, k, v and the output exchanged by all-to-all around attention, which runs on n_heads/(tp x cp) "
            f"heads of the whole sequence")


def activation_formula(inv: ModelInventory, layout: Layout) -> str:
    """The per-layer formula used, in words (see trainer/planner/activations.py)."""
    if inv.family == "gpt" and inv.attn_impl == "materialized":
        base = "Korthikanti et al. 2022 Table 2: sbh(34 + 5as/h) per layer (16-bit), /t with TP+SP"
    elif inv.family == "gpt":
        base = "GPT with fused SDPA: Korthikanti's 34sbh without the 5as^2b scores (q,k,v,out + logsumexp kept)"
    else:
        base = ("Llama block with SDPA and SwiGLU: e*sb*(4h + 2h_kv + 4f) + r*sb*2h + 4abs + 8sb bytes per layer "
                "on CUDA (e = activation bytes, r = residual-stream bytes; the CPU's composite RMSNorm adds 8sbh), "
                "TP splits heads/ffn, SP splits norms")
        if layout.casts_weights:
            base += ("; autocast over fp32 weights: fp32 residual stream and norms (r = 4), each projection's own "
                     "cast of its input (+3e*sbh) and e-byte copies of the matmul weights")
        if inv.family == "deepseek_v3":
            base += (" (DeepSeek-V3: multi-head latent attention term by term, its latents and norms included; "
                     "the dense blocks' SwiGLU of their own width, the MoE blocks' as f = (top_k + shared) x expert "
                     "width plus the dispatched tokens, expert outputs and routing tensors; each MTP depth: its "
                     "block's saved tensors, norms, head input and fp32 log-probabilities, outside the "
                     "checkpointed blocks)")
    schedule = layout.schedule if layout.pp > 1 else "(no pipeline)"
    cp = f"; s = {layout.local_seq_len} tokens per rank (cp={layout.cp})" if layout.cp > 1 else ""
    return f"{base}; policy {layout.checkpointing}; in-flight micro-batches by schedule {schedule}{cp}"
