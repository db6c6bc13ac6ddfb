"""`mode=plan plan.calibrate=true`: the planner's step time, tokens/s and peak memory for a configuration
beside what a short run of it on this machine measures.

The workers (trainer/planner/calibration_run.py) train the configuration for a few steps and measure the
hardware; here, on rank 0 (or the process that launched the workers), the measured matmul FLOP/s, memory
bandwidth and per-group latency and bandwidth replace the `hardware` group's figures (`calibrated_hardware`),
the planner predicts this exact configuration on that profile, and the two are printed side by side and
written to `calibration.json` in the run directory. `plan.calibrate_save=PATH` writes the profile as a
`conf/hardware` YAML file. Nothing here is fitted to the run's own times: the profile is hardware figures
only, so the comparison checks the planner's time model, not a constant tuned to this configuration.
"""

from __future__ import annotations

import copy
import json
import shlex
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer.config import validate
from trainer.planner.calibration_run import MEASURED_FILE, step_time
from trainer.planner.core import hardware_from_config, plan
from trainer.planner.hardware import HardwareConfig
from trainer.planner.profiles import cache_directory, machine_key, store_profile

CALIBRATION_FILE = "calibration.json"
MB = 1e6


def run_config(cfg: DictConfig) -> DictConfig:
    """The training run a calibration makes of a plan's config (validated as a run of this machine):
    warm-up + measured steps, no periodic validation (the final one is a single batch), no final checkpoint,
    no resume."""
    run = copy.deepcopy(cfg)  # keeps the structured types the run's builders expect
    OmegaConf.set_readonly(run, False)
    run.mode = "train"
    t = run.trainer
    t.max_steps = int(cfg.plan.calibrate_warmup) + int(cfg.plan.calibrate_steps)
    t.max_tokens = None
    t.val_every = 0
    t.val_batches = 1
    t.save_final = False
    run.resume = "none"
    validate(run)
    return run


def _worst(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Over the ranks that measured one (group, op): the highest latency and the lowest bandwidth."""
    return {"latency_s": max(r["latency_s"] for r in rows), "bandwidth_bps": min(r["bandwidth_bps"] for r in rows)}


def link_figures(record: dict[str, Any], devices_per_node: int) -> dict[str, dict[str, Any]]:
    """Per (group, op) the worst rank's latency per hop and bandwidth, and whether the group crosses nodes."""
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rank in record["ranks"]:
        for row in rank["links"]:
            by_key.setdefault((row["group"], row["op"]), []).append(row)
    out = {}
    for (group, op), rows in by_key.items():
        spans = len({r // devices_per_node for row in rows for r in row["ranks"]}) > 1
        out[f"{group}/{op}"] = {"group": group, "op": op, "size": rows[0]["size"], "spans_nodes": spans,
                                **_worst(rows)}
    return out


def calibrated_hardware(base: HardwareConfig, record: dict[str, Any], devices_per_node: int) -> HardwareConfig:
    """`base` with this machine's measured figures: each process's matmul peak per dtype and memory
    bandwidth with all processes busy (the slowest rank's), and the links' latency and bandwidth (the median
    over the groups and ops measured inside a node, and across nodes, of the slowest rank's figures).
    With 2 or more processes, the pipeline runtime's overhead per compute action. Figures nothing measured
    (inter-node links on one node, host memory and links; the pipeline overhead on one process) stay the
    base's."""
    ranks = record["ranks"]
    hardware = replace(base, name=f"{base.name}_calibrated", devices_per_node=devices_per_node)
    for dtype in ranks[0]["matmul_flops"]:
        setattr(hardware, f"peak_flops_{dtype}", min(r["matmul_flops"][dtype] for r in ranks))
    hardware.memory_bandwidth_gbps = min(r["memory_bandwidth_bps"] for r in ranks) / 1e9
    links = link_figures(record, devices_per_node).values()
    for spans, prefix in ((False, "intra"), (True, "inter")):
        rows = [row for row in links if row["spans_nodes"] == spans]
        if rows:
            setattr(hardware, f"{prefix}_node_bandwidth_gbps", statistics.median(r["bandwidth_bps"] for r in rows) / 1e9)
            setattr(hardware, f"{prefix}_node_latency_us", statistics.median(r["latency_s"] for r in rows) * 1e6)
    overheads = [r["pipeline_overhead_s"] for r in ranks if r.get("pipeline_overhead_s") is not None]
    if overheads:  # every rank returns the same figure (the median over the probe's pairs)
        hardware.pipeline_action_overhead_us = max(overheads) * 1e6
    inside = [row for row in links if not row["spans_nodes"]]
    ops = sorted({row["op"] for row in inside})
    hardware.intra_node_op_bandwidth_gbps = {
        op: statistics.median(r["bandwidth_bps"] for r in inside if r["op"] == op) / 1e9 for op in ops}
    hardware.intra_node_op_latency_us = {
        op: statistics.median(r["latency_s"] for r in inside if r["op"] == op) * 1e6 for op in ops}
    return hardware


def efficiencies(record: dict[str, Any], hardware: HardwareConfig) -> tuple[float, float | None]:
    """The fractions of the calibrated matmul peak the configuration's own matmul sizes and attention core
    reach (the slowest rank's), at most 1: what `plan.matmul_efficiency` and `plan.attention_efficiency`
    assume, measured (None: no fused attention to measure)."""
    ranks = record["ranks"]
    peak = getattr(hardware, f"peak_flops_{ranks[0]['compute_dtype']}")
    matmul = min(1.0, min(r["model_matmul_flops"] for r in ranks) / peak)
    if any(r["attention_flops"] is None for r in ranks):
        return matmul, None
    return matmul, min(1.0, min(r["attention_flops"] for r in ranks) / peak)


def with_hardware(cfg: DictConfig, hardware: HardwareConfig, matmul: float, attention: float | None) -> DictConfig:
    """A copy of `cfg` planning for `hardware`, its matmuls and attention core at these fractions of its peak."""
    planned = copy.deepcopy(cfg)
    OmegaConf.set_readonly(planned, False)
    for key, value in asdict(hardware).items():
        planned.hardware[key] = value
    planned.plan.matmul_efficiency = matmul
    planned.plan.attention_efficiency = attention
    return planned


def compare(cfg: DictConfig, record: dict[str, Any]) -> dict[str, Any]:
    """The calibration's figures: predicted (on the calibrated profile) and measured, and their ratios."""
    devices_per_node = int(cfg.trainer.devices)
    hardware = calibrated_hardware(hardware_from_config(cfg), record, devices_per_node)
    matmul, attention = efficiencies(record, hardware)
    planned = with_hardware(cfg, hardware, matmul, attention)
    if "grad_sync" in record:  # planned as the run settled it (grad_sync=auto decides on the machine's memory)
        planned.strategy.grad_sync, planned.strategy.reshard_after_backward = record["grad_sync"]
    predicted_plan = plan(planned, exact=False, search=False)
    measured_step = step_time(record)
    ranks = record["ranks"]
    phases = {key: statistics.median(max(step[key] for step in steps)
                                     for steps in zip(*(r["phases_s"] for r in ranks)))
              for key in ("data_s", "forward_backward_s", "optimizer_s")}
    predicted = {"step_time_s": predicted_plan.step_time_s, "tokens_per_s": predicted_plan.tokens_per_s,
                 "peak_memory_bytes": predicted_plan.memory["total"],
                 "per_rank_peak_memory_bytes": {str(k): v for k, v in predicted_plan.per_rank_total.items()},
                 "time_parts_s": predicted_plan.details["time"]}
    measured = {"step_time_s": measured_step, "tokens_per_s": record["tokens_per_step"] / measured_step,
                "peak_memory_bytes": max(r["peak_tensor_bytes"] for r in ranks),
                "per_rank_peak_memory_bytes": {str(r["rank"]): r["peak_tensor_bytes"] for r in ranks},
                "per_rank_peak_rss_bytes": {str(r["rank"]): r["peak_rss_bytes"] for r in ranks},
                "step_times_s": [max(times) for times in zip(*(r["step_times_s"] for r in ranks))],
                "phases_s": phases}
    return {
        "model": str(cfg.model.name), "strategy": predicted_plan.strategy, "world_size": record["world_size"],
        "dp": predicted_plan.dp, "tp": predicted_plan.tp, "pp": predicted_plan.pp, "cp": predicted_plan.cp,
        "dp_flavour": predicted_plan.dp_flavour, "precision": predicted_plan.precision,
        "num_microbatches": predicted_plan.num_microbatches, "micro_batch_size": predicted_plan.micro_batch_size,
        "warmup_steps": record["warmup_steps"], "steps": record["steps"], "threads": ranks[0]["threads"],
        "predicted": predicted, "measured": measured,
        "ratio": {key: predicted[key] / measured[key] if measured[key] else float("nan")
                  for key in ("step_time_s", "tokens_per_s", "peak_memory_bytes")},
        "hardware": asdict(hardware), "matmul_efficiency": matmul, "attention_efficiency": attention,
        "links": list(link_figures(record, devices_per_node).values()),
        "communication": predicted_plan.communication,
    }


def format_report(report: dict[str, Any]) -> str:
    """The side-by-side table and the calibrated figures."""
    p, m, r, hw = report["predicted"], report["measured"], report["ratio"], report["hardware"]
    parallel = f"dp={report['dp']} ({report['dp_flavour']}) x tp={report['tp']} x pp={report['pp']}" + (
        f" x cp={report['cp']}" if report["cp"] > 1 else "")
    lines = [f"calibration: {report['model']} on {report['world_size']} process(es) of this machine, strategy "
             f"{report['strategy']} ({parallel}), {report['precision']}, {report['num_microbatches']} micro-batch(es) "
             f"of {report['micro_batch_size']}; {report['steps']} steps timed after {report['warmup_steps']} "
             f"warm-up steps, {report['threads']} thread(s) per process",
             "",
             f"{'':<34}{'predicted':>12}{'measured':>12}{'predicted/measured':>20}",
             f"{'step time (s)':<34}{p['step_time_s']:>12.3f}{m['step_time_s']:>12.3f}{r['step_time_s']:>20.2f}",
             f"{'tokens/s':<34}{p['tokens_per_s']:>12,.0f}{m['tokens_per_s']:>12,.0f}{r['tokens_per_s']:>20.2f}",
             f"{'peak memory, busiest rank (MB)':<34}{p['peak_memory_bytes'] / MB:>12.1f}"
             f"{m['peak_memory_bytes'] / MB:>12.1f}{r['peak_memory_bytes']:>20.2f}",
             ""]
    t, ph = p["time_parts_s"], m["phases_s"]
    lines.append(f"predicted step: compute {t['compute_s']:.3f} + bubble {t['bubble_s']:.3f} + pipeline overhead "
                 f"{t['pipeline_overhead_s']:.3f} + exposed communication "
                 f"{t['exposed_communication_s']:.3f} + optimizer {t['optimizer_s']:.3f} s; measured (median, slowest "
                 f"rank): data {ph['data_s']:.3f} + forward/backward {ph['forward_backward_s']:.3f} + clip and "
                 f"optimizer {ph['optimizer_s']:.3f} s, the rest callbacks")
    lines.append("measured peak memory: live tensor bytes at the start of the last warm-up step plus their rise in it "
                 "(torch's CPU allocator records: trainer.memory.TensorPeakMeter); peak resident set per rank "
                 + ", ".join(f"{v / MB:.0f}" for v in m["per_rank_peak_rss_bytes"].values()) + " MB")
    lines.append(f"calibrated hardware (one process, all busy): matmul fp32 {hw['peak_flops_fp32'] / 1e9:.1f}, bf16 "
                 f"{hw['peak_flops_bf16'] / 1e9:.1f}, fp16 {hw['peak_flops_fp16'] / 1e9:.1f} GFLOP/s; memory "
                 f"{hw['memory_bandwidth_gbps']:.2f} GB/s; pipeline runtime {hw['pipeline_action_overhead_us']:.0f} us "
                 "per compute action")
    attention = report["attention_efficiency"]
    lines.append(f"at the configuration's own sizes, forward and backward: matmuls at {report['matmul_efficiency']:.0%} "
                 "of the peak (plan.matmul_efficiency), attention core at "
                 + (f"{attention:.0%}" if attention is not None else "the matmuls' rate")
                 + " (plan.attention_efficiency)")
    for link in report["links"]:
        lines.append(f"  {link['group']:<12} {link['op']:<15} {link['size']:>3} ranks: "
                     f"{link['latency_s'] * 1e6:8.1f} us per hop, {link['bandwidth_bps'] / 1e9:7.2f} GB/s sent per rank")
    return "\n".join(lines)


def hardware_yaml(hardware: HardwareConfig, command: str) -> str:
    """`hardware` as a conf/hardware YAML file, saying how it was measured."""
    lines = [f"# Measured by `mode=plan plan.calibrate=true` (trainer/planner/calibrate.py): per process with all "
             f"{hardware.devices_per_node} processes busy.", f"# {command}",
             "defaults:", "  - hardware_schema", "  - _self_"]
    def text(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{key}: {text(v)}" for key, v in value.items()) + "}"
        if isinstance(value, str):
            return json.dumps(value)
        written = f"{value:.4g}"
        mantissa, _, exponent = written.partition("e")
        if isinstance(value, float) and exponent and "." not in mantissa:
            # YAML 1.1 (PyYAML) reads 1e+11 as a string: a float needs a dot before its exponent
            written = f"{mantissa}.0e{exponent}"
        return written

    for key, value in asdict(hardware).items():
        lines.append(f"{key}: {text(value)}")
    return "\n".join(lines) + "\n"


def report(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """Read the workers' measurements in `run_dir`, print the comparison, write calibration.json (and the
    hardware YAML of `plan.calibrate_save`)."""
    record = json.loads((run_dir / MEASURED_FILE).read_text())
    result = compare(cfg, record)
    print(format_report(result))
    path = run_dir / CALIBRATION_FILE
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"calibration: {path}")
    # this machine's profile, cached for strategy=auto (trainer/planner/profiles.py): it calibrates only once
    cached = store_profile(cache_directory(cfg.plan.profile_dir),
                           machine_key(record["device"], int(cfg.trainer.devices)), HardwareConfig(**result["hardware"]),
                           result["matmul_efficiency"], result["attention_efficiency"],
                           "python -m trainer " + " ".join(shlex.quote(o) for o in overrides))
    print(f"calibrated profile cached for strategy=auto: {cached}")
    if cfg.plan.calibrate_save:
        target = Path(str(cfg.plan.calibrate_save))
        target.parent.mkdir(parents=True, exist_ok=True)
        hardware = HardwareConfig(**result["hardware"])
        command = "python -m trainer " + " ".join(shlex.quote(o) for o in overrides)
        target.write_text(hardware_yaml(hardware, command))
        print(f"calibrated hardware: {target} (hardware={target.stem} when it is in conf/hardware/)")
    if cfg.plan.format == "json":
        print(json.dumps(result, default=str, separators=(",", ":")))
    return result
