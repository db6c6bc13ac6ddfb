"""The plan as people read it (a table), as programs read it (one JSON line) and as a bar chart (PNG).

`mode=plan` exits with status 0 when the configuration fits, `EXIT_DOES_NOT_FIT` when it does not
(after saying what is short and listing the best configurations that fit), 2 on a config error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig

from trainer.planner.core import GB, MEMORY_FIELDS, Plan, plan
from trainer.planner.phases import PHASE_DESCRIPTIONS

EXIT_DOES_NOT_FIT = 3
LABELS = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer states",
    "activations": "activations",
    "temporaries": "temporary buffers",
    "total": "total",
}
# The chart's and the peak line's labels of a phase's parts (its gradients are those present then).
PHASE_LABELS = {**LABELS, "grads": "gradients present"}


def _gb(value: float) -> str:
    return f"{value / GB:9.3f}"


def _bytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def format_table(result: Plan) -> str:
    """The human report."""
    lines = []
    mb = result.micro_batch_size
    active = (f", {result.num_active_params / 1e9:.3f} B active per token"
              if result.num_active_params and result.num_active_params != result.num_params else "")
    lines.append(f"plan: {result.model} ({result.num_params / 1e9:.3f} B parameters{active}) on {result.world_size} x "
                 f"{result.hardware}; strategy {result.strategy}: dp={result.dp} ({result.dp_flavour}) x "
                 f"tp={result.tp} x pp={result.pp}" + (f" x cp={result.cp}" if result.cp > 1 else "")
                 + (f", experts split over ep={result.ep} of the dp ranks" if result.ep > 1 else ""))
    if result.context_parallel:
        lines.append(f"      {result.context_parallel}")
    lines.append(f"      precision {result.precision}, activation checkpointing {result.checkpointing}, "
                 f"{result.num_microbatches} micro-batch(es) of {mb} per step and data-parallel rank")
    lines.append(f"      {result.convention}")
    lines.append("")
    has_exact = result.exact is not None
    header = f"memory of rank {result.rank} (GB = 1e9 bytes)      analytic" + ("       exact" if has_exact else "")
    lines.append(header)
    for key in MEMORY_FIELDS:
        held = result.state_bytes.get(key, result.memory[key])  # model states wherever they live
        label = "total on the device" if key == "total" else LABELS[key]
        row = f"  {label:<32}{_gb(held)}"
        if has_exact and key in result.exact:  # type: ignore[operator]
            row += f"   {_gb(result.exact[key])}"  # type: ignore[index]
        if key in result.state_bytes and result.memory[key] != held:
            row += "   (in host memory: offloaded)"
        if key == "temporaries" and result.peak_phase:
            row += "   (at the peak)"
        if key == "total" and result.peak_phase:
            row += "   (the peak: not the sum of the above)"
        lines.append(row)
    phases = result.details.get("phases", {})
    if result.peak_phase in phases:
        at_peak = phases[result.peak_phase]
        lines.append(f"  at the peak, the {PHASE_DESCRIPTIONS[result.peak_phase]} [{result.peak_phase}]: "
                     + " + ".join(f"{PHASE_LABELS[k]} {at_peak[k] / GB:.3f}" for k in MEMORY_FIELDS if k != "total")
                     + f" = {at_peak['total'] / GB:.3f}")
        lines.append("  phases of a step (GB): " + ", ".join(f"{k} {v['total'] / GB:.3f}" for k, v in phases.items()))
    if result.host_bytes:
        lines.append(f"  {'host memory (offloaded)':<32}{_gb(result.host_bytes)}   "
                     f"of {result.host_capacity_bytes / GB:.1f} usable")
    lines.append(f"  {'usable on the device':<32}{_gb(result.capacity_bytes)}")
    if has_exact:
        lines.append("  exact: the real model on the meta device, the real strategy as this rank of a fake process "
                     "group; bytes counted")
    elif result.exact_error:
        lines.append(f"  exact: not available ({result.exact_error})")
    act = result.details["activations"]
    lines.append(f"  activations: {act['layers']} layers x {_bytes(act['per_layer_kept_bytes'])} per layer and "
                 f"micro-batch x {act['in_flight_microbatches']:g} in flight"
                 + (f" ({act['checkpointed_layers']} checkpointed)" if act["checkpointed_layers"] else "")
                 + (f", first stage +{_bytes(act['first_stage_bytes'])}" if act["first_stage_bytes"] else "")
                 + (f", last stage +{_bytes(act['last_stage_bytes'])}" if act["last_stage_bytes"] else "")
                 + (f", stage inputs/outputs +{_bytes(act['pipeline_boundary_bytes'])}"
                    if act["pipeline_boundary_bytes"] else ""))
    lines.append(f"    {result.activation_formula}")
    temps = result.details["temporaries"]
    if temps:
        lines.append(f"  temporaries at the peak ({result.peak_phase}): "
                     + "; ".join(f"{k} {_bytes(v)}" for k, v in temps.items()))
    if result.peak_phase != "optimizer_step" and result.details["optimizer_step_temporaries"]:
        lines.append("  temporaries of the optimizer step: "
                     + "; ".join(f"{k} {_bytes(v)}" for k, v in result.details["optimizer_step_temporaries"].items()))
    if len(result.per_rank_total) > 1:
        lines.append("  per pipeline rank: "
                     + ", ".join(f"rank {r}: {v / GB:.2f}" for r, v in result.per_rank_total.items()))
    lines.append("")
    lines.append(f"fits: {'yes' if result.fits else 'NO'}")
    for short in result.shortfall:
        lines.append(f"  short: {short}")
    lines.append("")
    lines.append(f"pipeline bubble fraction: {result.bubble_fraction:.3f}")
    if result.communication:
        lines.append(f"communication per step of rank {result.rank} (ring algorithms):")
        lines.append(f"  {'dim':<4} {'op':<15} {'group':>5} {'count':>6} {'payload':>11} {'sent':>11} {'time':>11}")
        for c in result.communication:
            where = "across nodes" if c["spans_nodes"] else "in a node"
            lines.append(f"  {c['dimension']:<4} {c['op']:<15} {c['group_size']:>5} {c['count']:>6} "
                         f"{_bytes(c['payload_bytes']):>11} {_bytes(c['sent_bytes']):>11} "
                         f"{c['time_s'] * 1e3:8.1f} ms  {where}")
    time = result.details["time"]
    lines.append(f"model FLOPs per token (Narayanan et al. 2021: 6 x matmul weights + 12 x layers x seq x attention "
                 f"width; MLA: 6 x blocks x seq x heads x (qk + v head widths)): {result.flops_per_token:.4g}; "
                 f"per step {result.flops_per_step:.4g}")
    lines.append(f"estimated step time {result.step_time_s:.3f} s = compute {time['compute_s']:.3f} + bubble "
                 f"{time['bubble_s']:.3f} + pipeline overhead {time['pipeline_overhead_s']:.3f} + exposed "
                 f"communication {time['exposed_communication_s']:.3f} + optimizer "
                 f"{time['optimizer_s']:.3f} + offload {time['offload_s']:.3f} (matmuls at "
                 f"{result.details['matmul_efficiency']:.0%} of peak, attention core at "
                 f"{result.details['attention_efficiency']:.0%})")
    lines.append(f"estimated {result.tokens_per_s:,.0f} tokens/s, MFU {result.mfu:.1%}")
    for warning in result.warnings:
        lines.append(f"warning: {warning}")
    if result.suggestions:
        lines.append("")
        lines.append(f"configurations that fit, best estimated throughput first (top {len(result.suggestions)}):")
        for index, s in enumerate(result.suggestions, 1):
            lines.append(f"  {index}. {s.description}: {s.memory_gb:.2f} GB, {s.tokens_per_s:,.0f} tokens/s, "
                         f"MFU {s.mfu:.1%}")
            lines.append(f"     {s.command}")
    elif not result.fits:
        lines.append("")
        lines.append("no configuration of this model and global batch fits this world size and hardware: "
                     "add devices, pick bigger ones, or lower trainer.seq_len / trainer.global_batch_size")
    return "\n".join(lines)


def write_chart(title: str, bars: Sequence[tuple[str, dict[str, float], float]], path: str | Path) -> Path:
    """A stacked bar (params, grads, optimizer, activations, temporaries; bytes) per (label, memory,
    usable bytes), with the usable memory as a dashed line. `memory`: what exists at the peak phase
    (`Plan.details["phases"][peak_phase]`, `Suggestion.at_peak`), whose parts sum to its total."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [k for k in MEMORY_FIELDS if k != "total"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(bars) + 2), 4.5))
    for index, (label, memory, usable) in enumerate(bars):
        bottom = 0.0
        for part_index, key in enumerate(parts):
            value = memory[key] / GB
            ax.bar(index, value, bottom=bottom, color=f"C{part_index}", label=PHASE_LABELS[key] if index == 0 else None)
            bottom += value
        ax.hlines(usable / GB, index - 0.4, index + 0.4, colors="black", linestyles="dashed",
                  label="usable memory" if index == 0 else None)
    ax.set_xticks(range(len(bars)), [label for label, _, _ in bars], rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("GB per device at its peak (rank with the most)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(cfg: DictConfig, overrides: list[str]) -> int:
    """`mode=plan`: print the report (and the JSON line), write the chart; the exit status."""
    result = plan(cfg, overrides=overrides)
    print(format_table(result))
    if cfg.plan.chart:
        bars = [("configured", result.details["phases"][result.peak_phase], result.capacity_bytes)]
        bars += [(f"#{i} {s.description}", s.at_peak or s.memory, s.capacity_bytes)
                 for i, s in enumerate(result.suggestions, 1)]
        title = f"{result.model} on {result.world_size} x {result.hardware}"
        print(f"memory chart: {write_chart(title, bars, cfg.plan.chart)}")
    if cfg.plan.format == "json":
        print(result.to_json())
    return 0 if result.fits else EXIT_DOES_NOT_FIT

